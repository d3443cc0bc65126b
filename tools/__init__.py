"""The benchmarks of shmrl, and the baselines they compare it with: one module per tool,
each a command (``python tools/NAME.py --help``), with a ``--quick`` mode that a test runs;
tools/shared.py holds what they share (processes, the baselines' virtualenvs, the frame of
every report). The pass/fail harnesses (abuse, hostile messages, the README's commands) are
tests: tests/harness/.

How a tool runs. Tools import each other as a package (``from tools import shared``), which
needs the repository's root on sys.path, where ``python -m tools.NAME`` puts it (run from
the root). ``python tools/NAME.py``, the form docs, CI and the issues name, puts tools/
there instead, from any folder. Each tool therefore starts with a two-line guard: run as a
file, it hands over to tools/run_as_module.py, which puts the root in tools/' place on
sys.path (the one place that edits it) and runs the same file as the module
``tools.NAME`` in this interpreter (runpy, no second process: the pid, signals and exit
status stay those of the command). Running it under its package name keeps one copy of each
module, lets multiprocessing's children import the main module by that name, and keeps the
tools' import graph checkable (tests/test_layers.py). The alternatives were worse: a
sys.path edit at the top of every tool, or installing tools/ as a package, which would make
the baselines' virtualenvs (which run some tools with their own python) install shmrl.

Standard library only at import: the baselines' interpreters import this package.
"""
