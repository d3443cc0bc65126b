"""The settings of a run, each defined once (default, help, check), and what every command
line of shmrl shares: its exit statuses, its one-line errors."""
from __future__ import annotations

import argparse

EXIT_SOLVED, EXIT_BUDGET, EXIT_USAGE, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class ConfigError(ValueError):
    """What the run was asked to do cannot be done, found before anything starts: a bad
    setting, a port in use, a log folder that cannot be made, a checkpoint that is damaged
    or does not fit. ``python -m shmrl.run`` prints it as one line and exits 2."""


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one line, ``error: ...``, and exit 2."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"error: {message} (see {self.prog} --help)\n")
