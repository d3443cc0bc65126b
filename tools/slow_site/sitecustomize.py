"""Python imports this at start up when tools/slow_site is on PYTHONPATH. With
$SLOW_SIM_STEPS_PER_S set it throttles gymnasium's HalfCheetah-v5, Hopper-v5, ... under
their own ids (tools/slow_sim.py, ``throttle_base_ids``), so that a trainer given
``gym:HalfCheetah-v5`` trains that env, presets and all, on a slow simulator: what
tools/slow_sims.py measures. Without the variable it does nothing (not even import gymnasium)."""
import os
import sys

if float(os.environ.get("SLOW_SIM_STEPS_PER_S") or 0) > 0:
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tools/: slow_sim
    import slow_sim

    slow_sim.throttle_base_ids()
