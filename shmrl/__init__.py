"""shmrl: PPO for simulators that run their own loop, over shared-memory RLlink rings."""
__version__ = "0.1.0"
