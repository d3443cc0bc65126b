"""``python tools/NAME.py`` run as the module ``tools.NAME`` (tools/__init__.py says why).

A tool's guard imports this file as a top-level module (python put tools/ first on sys.path
for the script) and calls ``run(__file__)``, which never returns.
"""
import os
import runpy
import sys


def run(script: str) -> None:
    """Run the tool file ``script`` as ``tools.NAME`` with ``__name__ == "__main__"``, then
    exit: tools/ on sys.path gives way to the repository's root, so that a tool finds its
    siblings only as ``tools.*``."""
    tools = os.path.dirname(os.path.abspath(script))
    root = os.path.dirname(tools)
    if sys.path and os.path.abspath(sys.path[0] or os.curdir) == tools:
        sys.path[0] = root
    else:
        sys.path.insert(0, root)
    name = "tools." + os.path.splitext(os.path.basename(script))[0]
    runpy.run_module(name, run_name="__main__", alter_sys=True)
    sys.exit(0)
