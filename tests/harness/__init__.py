"""The pass/fail harnesses: whole runs of shmrl under abuse and hostile messages, and the
README's commands as written. They are tests, not benchmarks (tools/ holds those): the
tests in tests/test_abuse.py, tests/test_flood.py and tests/test_tools.py run them, the
long ones marked slow. Each is also a command, run from the repository's root:

    python -m tests.harness.abuse [--quick] [--json]
    python -m tests.harness.abuse_messages [--quick] [--only NAME ...] [--json]
    python -m tests.harness.readme_commands [--quick]

They import tools.shared (processes, the report frame) and each other relatively, so that
the same files load as ``harness.NAME`` under pytest (tests/ on sys.path) and as
``tests.harness.NAME`` from the root.
"""
