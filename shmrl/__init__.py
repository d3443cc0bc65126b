"""shmrl: PPO for simulators that run their own loop, over shared-memory RLlink rings.

    import shmrl
    summary = shmrl.train(shmrl.Config(env="Pendulum-v1", sims=4, seed=1))

``Config`` has one field per flag of ``python -m shmrl.run`` (shmrl/config/settings.py defines
each: default, help, check); fields left None take the environment's defaults. ``env``
may also be a callable that makes a gymnasium-style env (a lambda or a closure: the
simulator processes get it through dill).
"""
from shmrl.config.settings import Config, ConfigError

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "train"]


def train(config: Config | None = None, **fields) -> dict:
    """Train as ``python -m shmrl.run`` does and return the run's summary (``solved``,
    ``return_mean``, ``env_steps``, ``wall_s``, ``exit_status``, ...; also written to
    ``summary.json`` in its log folder). Fields may be given as keywords, instead of a
    Config or over it. A setting that cannot be raises ConfigError at once, before
    anything is started or written, with the message the command line prints."""
    from shmrl.config.settings import config_with
    from shmrl.run import train as run_training   # lazily: simulators import shmrl, never the trainer

    _, summary = run_training(config_with(config, **fields))
    return summary
