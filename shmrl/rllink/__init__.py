"""RLlink, the wire protocol of docs/RLLINK.md: message types and their validation
(``messages``), framing and the two codecs (``codec``), the episodes' fields
(``episodes``), server-side inference's ACT (``act``, ``act_multi_agent``) and the field
checks they share (``fields``). It knows nothing of sockets, shared memory or torch.

What a transport or a client needs is named here, so that ``from shmrl import rllink``
and ``rllink.encode(msg)`` read as the protocol's own words.
"""
from shmrl.rllink.act import MAX_ACT_ENVS
from shmrl.rllink.codec import (CODECS, HEADER_LEN, MAGIC, MAX_BODY_LEN, ProtocolError, decode, encode,
                                encode_binary, encode_json, episodes_body_bytes, frame, parse_header,
                                set_state_body_bytes, show)
from shmrl.rllink.messages import (DECLARED_FIELDS, REPLY_TYPES, REQUEST_TYPES, MessageLimits, MessageType,
                                   declared_spaces, decode_reply, decode_request, validate)

__all__ = ["CODECS", "DECLARED_FIELDS", "declared_spaces", "HEADER_LEN", "MAGIC", "MAX_ACT_ENVS", "MAX_BODY_LEN", "REPLY_TYPES", "REQUEST_TYPES",
           "MessageLimits", "MessageType", "ProtocolError", "decode", "decode_reply", "decode_request", "encode",
           "encode_binary", "encode_json", "episodes_body_bytes", "frame", "parse_header", "set_state_body_bytes",
           "show", "validate"]
