"""shmrl: PPO for simulators that run their own loop, over shared-memory RLlink rings.

    import shmrl
    summary = shmrl.train(shmrl.Config(env="Pendulum-v1", sims=4, seed=1))

``Config`` has one field per flag of ``python -m shmrl.run``; fields left None take the
environment's defaults. ``env`` may also be a callable that makes a gymnasium-style env
(a lambda or a closure: the simulator processes get it through dill).
"""
__version__ = "0.1.0"
__all__ = ["Config", "train"]


def __getattr__(name: str):
    # Lazily: importing shmrl.run here would make `python -m shmrl.run` import it twice
    # (runpy warns about exactly that), and simulators never need it.
    if name == "Config":
        from shmrl.run import RunConfig
        return RunConfig
    raise AttributeError(f"module 'shmrl' has no attribute {name!r}")


def train(config=None, **fields) -> dict:
    """Train as ``python -m shmrl.run`` does and return the run's summary (``solved``,
    ``return_mean``, ``env_steps``, ``wall_s``, ``exit_status``, ...; also written to
    ``summary.json`` in its log folder). Fields may be given as keywords instead."""
    from shmrl.run import RunConfig, train as run_training

    _, summary = run_training(config if config is not None else RunConfig(**fields))
    return summary
