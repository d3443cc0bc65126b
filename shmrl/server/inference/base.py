"""Server-side inference's interface (docs/RLLINK.md, "Server-side inference"): what the Hub
asks of it, the code its two kinds share, and the default that serves no actions.

The Hub keeps, per connection, the inference that answers its ACTs: the run's
(``ServerInference``, ``MultiAgentInference``) once its PING asked for it, else a
``NoInference`` that refuses them. So it never asks which kind it has.
"""
from __future__ import annotations

import contextlib
import logging

from shmrl import rllink

log = logging.getLogger("shmrl.learner")
_ACTIONS = rllink.MessageType.ACTIONS.value
NOT_ASKED = "ACT from a client whose PING did not ask for server-side inference"
NOT_SERVED = "ACT in a run that does not serve actions (its PONG said so)"


class Inference:
    """The policy run for the connections that asked for it in their PING, and their trajectories.

    ``act(conn_id, msg)`` records a validated ACT: the connection's chunks once its sample is
    complete (else None), and why the ACT breaks its connection (else None). The Hub then
    lets the connection ``go_on`` (its ACT ``queue``d for the next ``flush``) or ``hold``s it
    until new weights. ``flush(reply)`` answers every queued ACT with one forward pass (per
    policy); ``load`` takes each newly published version; ``forget`` drops a closed
    connection. A kind keeps one slot per connection in ``slots``, each with its ``k`` envs
    and a ``queued`` flag, and writes ``act``, ``load``, ``forget``, ``_gather`` and ``_forward``.
    """

    pong_fields = {"inference": "server"}   # what the PONG says to a client that asked for it
    unasked: NoInference                     # the inference of a connection whose PING did not ask

    def __init__(self):
        self.slots: dict = {}
        self.queued: list[str] = []          # connections whose ACT the next flush answers
        self.version = -1
        self.forward_passes = 0
        self.rows = 0                        # env rows acted on, in all

    def act(self, conn_id: str, msg: dict) -> tuple:
        raise NotImplementedError

    def load(self, version: int, policies: dict) -> None:
        """The policies published as ``version`` (SET_STATE's ``policies`` entries) act from now on."""
        raise NotImplementedError

    def forget(self, conn_id: str) -> int:
        """The connection is closed: its open sample is lost; returns its env steps."""
        raise NotImplementedError

    def go_on(self, conn_id: str, send_state) -> None:
        """The connection may go on: its ACT is answered by the next ``flush``."""
        self.queue(conn_id)

    def queue(self, conn_id: str) -> None:
        """Answer this connection's ACT in the next ``flush``."""
        self.slots[conn_id].queued = True
        self.queued.append(conn_id)

    def hold(self, conn_id: str) -> None:
        """Its ACT waits (new weights, a full batch); ``queue`` it when it may go on."""
        self.slots[conn_id].queued = True

    def flush(self, reply, together=contextlib.nullcontext) -> list[tuple[str, str]]:
        """Act for every queued connection and ``reply(conn_id, ACTIONS)`` to each, the replies
        inside ``together(conn_ids)`` (a transport that can sends them at once). Returns
        (conn_id, why) of those that could not be served."""
        if not self.queued:
            return []
        conns = [c for c in dict.fromkeys(self.queued) if c in self.slots]
        self.queued = []
        if not conns:
            return []
        slots = [self.slots[c] for c in conns]
        gathered = self._gather(conns, slots)
        with together(conns):
            try:
                actions = self._forward(gathered)
            except Exception as e:   # a policy that does not fit the obs: those clients cannot be served
                log.exception("server-side inference failed")
                return [(c, f"server-side inference failed: {type(e).__name__}: {e}"[:300]) for c in conns]
            for conn_id, slot, chosen in zip(conns, slots, actions):
                slot.queued = False
                reply(conn_id, {"type": _ACTIONS, "actions": chosen, "weights_seq_no": self.version})
        return []

    def _gather(self, conns: list[str], slots: list):
        """What ``_forward`` needs of the queued connections (what cannot fail for a client's input)."""
        raise NotImplementedError

    def _forward(self, gathered) -> list:
        """The forward pass: each queued connection's ACTIONS ``actions``, in order."""
        raise NotImplementedError


class NoInference:
    """Serves no actions: the inference of a run without server-side inference, and of a
    connection whose PING did not ask for it. Its ACTs are refused (``refusal``); once it may
    go on, a connection gets the current weights, for the policy it runs itself."""

    pong_fields: dict = {}
    queued = ()

    def __init__(self, refusal: str):
        self.refusal = refusal
        self.unasked = self

    def act(self, conn_id: str, msg: dict) -> tuple[None, str]:
        return None, self.refusal

    def go_on(self, conn_id: str, send_state) -> None:
        send_state(conn_id)

    def queue(self, conn_id: str) -> None:
        pass

    def hold(self, conn_id: str) -> None:
        pass

    def flush(self, reply, together=contextlib.nullcontext) -> list[tuple[str, str]]:
        return []

    def load(self, version: int, policies: dict) -> None:
        pass

    def forget(self, conn_id: str) -> int:
        return 0


Inference.unasked = NoInference(NOT_ASKED)
