"""Python imports this at start up when tools/slow_site is on PYTHONPATH (the repository's
root beside it, for tools.slow_sim). With
$SLOW_SIM_STEPS_PER_S set, a process that imports gymnasium gets HalfCheetah-v5, Hopper-v5,
... throttled under their own ids (tools/slow_sim.py, ``throttle_base_ids``), so that a
trainer given ``gym:HalfCheetah-v5`` trains that env, presets and all, on a slow simulator:
what tools/slow_sims.py measures. Nothing is imported before gymnasium is (a process that
never uses it, such as multiprocessing's resource tracker, starts and ends as fast as ever);
without the variable nothing happens at all."""
import importlib.abc
import os
import sys

class _ThrottleOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when gymnasium is found, its module throttles the base ids as
    soon as it has run."""

    def find_spec(self, name, path=None, target=None):
        if name != "gymnasium":
            return None
        sys.meta_path.remove(self)
        spec = next((s for s in (f.find_spec(name, path, target) for f in sys.meta_path
                                 if hasattr(f, "find_spec")) if s is not None), None)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                from tools import slow_sim  # the repository's root is on PYTHONPATH beside tools/slow_site

                slow_sim.throttle_base_ids()

            spec.loader.exec_module = exec_module
        return spec


if float(os.environ.get("SLOW_SIM_STEPS_PER_S") or 0) > 0:
    sys.meta_path.insert(0, _ThrottleOnImport())
