"""The trainer: one run object and the one loop over a set of policies (take a batch,
update, publish, log, checkpoint), with its set-up, resuming, reports, learning per env
step, self-play evaluations and pretraining.

``train_with_servers`` is named here for callers that bring their own transports
(docs/EXTERNAL.md).
"""
from shmrl.trainer.loop import train_with_servers

__all__ = ["train_with_servers"]
