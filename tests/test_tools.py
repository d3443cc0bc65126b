"""The tools in tools/ run, in their --quick modes, and say what they measured: each test
parses a tool's --json output and checks its fields, and that the tool stopped every
process it started and left no /dev/shm/shmrl_* file. The pass/fail harnesses of
tests/harness/ run here too, marked slow. Tools are imported as the package they are
(``from tools import bench``: ``python -m pytest`` from the repository's root has it on
sys.path) and run as the commands docs name (``python tools/NAME.py``).

The stable-baselines3 and RLlib tests need those libraries' own virtualenvs, which
``.ci/run`` creates before the tests (``python tools/sb3_baseline.py --setup``,
``python tools/rllib_compat.py --setup``); on a machine that never made them they skip.
"""
import json
import math
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from tools import bench, shared

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"
SB3_PYTHON = shared.SB3.folder / "bin" / "python"
RLLIB_PYTHON = shared.RLLIB.folder / "bin" / "python"
MARK = "SHMRL_TOOLS_TEST_MARK"   # in the environment of every process a tool starts


def marked(mark: str) -> list[int]:
    """Live processes whose environment holds ``MARK=mark``: a tool's and all it started,
    even those that moved to a session of their own."""
    out = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARK) == mark:
                out.append(proc.pid)
        except psutil.Error:  # gone, or not ours to read
            continue
    return out


class Tool:
    """Runs a tool in its own session with a mark in its environment; what it leaves
    running is found by that mark, killed, and reported in teardown."""

    def __init__(self, cwd: Path):
        self.cwd, self.mark, self.procs = cwd, uuid.uuid4().hex, []

    def __call__(self, script: str, *args, timeout: float) -> tuple[int, str, str]:
        """``script``: tools/NAME.py as the file it is, or a harness module (tests.harness.NAME)."""
        env = dict(os.environ, **{MARK: self.mark})
        if script.endswith(".py"):
            cmd = [sys.executable, str(TOOLS / script)]
        else:
            cmd = [sys.executable, "-m", script]
            env = shared.repo_on_pythonpath(env)
        proc = subprocess.Popen([*cmd, *map(str, args)], cwd=self.cwd, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.procs.append(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            out, err = proc.communicate(timeout=10)
            pytest.fail(f"{script} {' '.join(map(str, args))} still running after {timeout} s:\n{err[-3000:]}")
        return proc.returncode, out, err

    def kill_all(self) -> list[int]:
        left = marked(self.mark)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            if proc.poll() is None:
                proc.wait(10)
        return left


@pytest.fixture
def tool(tmp_path, no_shm_leftovers):
    """A runner for tools/*.py and tests/harness/*.py; afterwards, no process the tool started may be left running
    (no_shm_leftovers: nor any /dev/shm/shmrl_* file)."""
    runner = Tool(tmp_path)
    yield runner
    left = runner.kill_all()
    assert not left, f"processes the tool started were still running (killed now): {left}"


def last_json(out: str) -> dict:
    lines = out.strip().splitlines()
    assert lines, "no output"
    return json.loads(lines[-1])


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_median_and_percentile_take_any_iterable():
    assert bench.median(x for x in [3.0, 1.0, 2.0]) == 2.0          # a generator, as throughput passes
    assert bench.median([4, 1, 3, 2]) == 2.5
    assert bench.median is shared.median   # the report frame is shared, not copied
    assert bench.percentile((x for x in range(101)), 90) == 90.0
    assert math.isnan(bench.median(x for x in [])) and math.isnan(bench.percentile(iter(()), 50))


def test_a_baseline_virtualenv_is_reused_when_complete_and_remade_when_not(tmp_path):
    """tools/shared.py's virtualenvs: a folder whose python has the modules and the pinned versions is used
    as it is (no pip); a missing module or another pinned version makes it build again."""
    import numpy as np

    venvs = shared
    folder = tmp_path / "venv"
    (folder / "bin").mkdir(parents=True)
    python = folder / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')   # this interpreter, with its numpy
    python.chmod(0o755)

    class Rebuild(Exception):
        pass

    def log(message):
        raise Rebuild(message)   # stops before pip: the test needs no network

    complete = venvs.Venv("test-venv", "test", (f"numpy=={np.__version__}",), ("numpy", "json"))
    assert complete.ensure(folder, log=log) == python
    for incomplete in (venvs.Venv("test-venv", "test", ("numpy==0.0.1",), ("numpy",)),
                       venvs.Venv("test-venv", "test", (), ("no_such_module_at_all",))):
        with pytest.raises(Rebuild, match=f"creating the test virtualenv in {folder}"):
            incomplete.ensure(folder, log=log)
    # The tools' own folders are the ones .ci/run and existing machines have.
    assert [v.folder.name for v in (venvs.SB3, venvs.RLLIB, venvs.ZOO)] == ["sb3-venv", "rllib-2.48-venv", "zoo-venv"]
    assert all("torch==2.13.0" in v.packages for v in (venvs.SB3, venvs.RLLIB, venvs.ZOO))


def check_common(r: dict, subcommand: str) -> None:
    assert r["subcommand"] == subcommand and isinstance(r["method"], str) and len(r["method"]) > 100
    assert r["torch_imported"] is False                                  # the bench itself stays light
    for host in (r["host_before"], r["host_after"]):
        assert positive(host["cpus"]) and len(host["loadavg"]) == 3


def test_bench_throughput_quick(tool):
    rc, out, err = tool("bench.py", "throughput", "--quick", "--json", timeout=120)
    assert rc == 0, err[-3000:]
    r = last_json(out)
    check_common(r, "throughput")
    p = r["params"]
    assert p["sims"] == [2] and p["repeat"] == 2
    limit = r["limit"]
    assert limit["processes"] == r["host_before"]["cpus"] == len(limit["per_process"])
    assert positive(limit["steps_per_s"]) and positive(limit["steps_per_cpu_s"])
    assert len(limit["windows"]) == p["repeat"] and all(positive(w) for w in limit["windows"])
    assert p["transport"] == ["shm", "tcp-binary"]                     # side by side
    assert [(row["sims"], row["transport"]) for row in r["pipeline"]] == [(2, "shm"), (2, "tcp-binary")]
    for row in r["pipeline"]:
        assert row["sims"] == 2 and len(row["windows"]) == p["repeat"]
        assert positive(row["steps_per_s"]) and all(positive(w) for w in row["windows"])
        assert row["ratio_to_limit"] == pytest.approx(row["steps_per_s"] / limit["steps_per_s"])
        assert positive(row["ready_s"]) and positive(row["sims_cpu_cores"])
    best = max(r["pipeline"], key=lambda row: row["steps_per_s"])
    assert r["best"] == {"sims": 2, "transport": best["transport"], "steps_per_s": best["steps_per_s"],
                         "ratio_to_limit": best["ratio_to_limit"]}
    shm, tcp = r["pipeline"]
    assert r["tcp_binary_to_shm"] == {"2": pytest.approx(tcp["steps_per_s"] / shm["steps_per_s"])}


def test_bench_transport_quick(tool):
    rc, out, err = tool("bench.py", "transport", "--quick", "--json", timeout=120)
    assert rc == 0, err[-3000:]
    r = last_json(out)
    check_common(r, "transport")
    p = r["params"]
    assert set(r["variants"]) == {"shm-binary", "shm-json", "tcp-binary", "tcp-json"}
    for v in r["variants"].values():
        assert positive(v["us_per_step"]) and positive(v["rtt_ms"]) and positive(v["client_encode_us_per_step"])
        assert v["us_per_step"] == pytest.approx(v["rtt_ms"] * 1e3 / p["steps"])
        assert len(v["repeats_us_per_step"]) == p["repeat"]
    # The same message in both codecs: JSON is the bigger body, and both JSON variants carry it.
    assert r["variants"]["shm-json"]["body_bytes"] == r["variants"]["tcp-json"]["body_bytes"] \
        > r["variants"]["shm-binary"]["body_bytes"] == r["variants"]["tcp-binary"]["body_bytes"] > 0
    # Every request answered (and each TCP client's PING, where the codec is agreed).
    assert r["messages_served"] == 4 * p["repeat"] * (p["warmup"] + p["messages"])
    us = {v: x["us_per_step"] for v, x in r["variants"].items()}
    for ratio, (a, b) in {"tcp-json/shm-binary": ("tcp-json", "shm-binary"),
                          "tcp-json/tcp-binary": ("tcp-json", "tcp-binary"),
                          "tcp-binary/shm-binary": ("tcp-binary", "shm-binary")}.items():
        assert r["ratios"][ratio] == pytest.approx(us[a] / us[b])


@pytest.mark.slow   # among the suite's longest (25-40 s)
def test_bench_on_image_observations_keeps_them_uint8(tool):
    """transport and throughput take --env: MinAtar's 10x10x4 boolean planes travel as one
    byte per value in the binary codec, and the pipeline samples the env it is given."""
    pytest.importorskip("minatar", reason="the minatar extra is not installed (the test extra has it)")
    env = "gym:MinAtar/Breakout-v1"
    rc, out, err = tool("bench.py", "transport", "--quick", "--json", "--env", env, timeout=120)
    assert rc == 0, err[-3000:]
    r = last_json(out)
    check_common(r, "transport")
    steps = r["params"]["steps"]
    assert r["params"]["env"] == env
    binary = r["variants"]["shm-binary"]["body_bytes"]
    image_bytes = (steps + 1) * 10 * 10 * 4                              # uint8: a byte per value
    assert image_bytes < binary < image_bytes + 64 * steps + 4096         # not 4 bytes per value
    assert r["variants"]["tcp-json"]["body_bytes"] > 2 * binary
    assert positive(r["variants"]["shm-binary"]["ns_per_body_byte"])
    # throughput's --env reaches the simulators and the limit's loops (a cheap env: the CNN's
    # start-up would cost the suite tens of seconds).
    rc, out, err = tool("bench.py", "throughput", "--quick", "--json", "--env", "Pendulum-v1", timeout=120)
    assert rc == 0, err[-3000:]
    r = last_json(out)
    check_common(r, "throughput")
    assert r["params"]["env"] == "Pendulum-v1" and "Pendulum-v1 policy network" in r["method"]
    assert positive(r["limit"]["steps_per_s"]) and positive(r["pipeline"][0]["steps_per_s"])


def test_bench_solve_quick(tool):
    rc, out, err = tool("bench.py", "solve", "--quick", "--json", timeout=180)
    assert rc == 0, err[-3000:]
    r = last_json(out)
    check_common(r, "solve")
    assert r["params"]["extra"] == ["--stop-return", "100"] and r["params"]["seeds"] == [0]
    (run,) = r["runs"]
    assert run["seed"] == 0 and run["exit"] == 0 and run["solved"] is True
    assert run["return_mean"] >= 100 and positive(run["env_steps"]) and positive(run["wall_s"])
    assert r["all_solved"] is True and r["median_wall_s"] == run["wall_s"] and r["median_env_steps"] == run["env_steps"]


def test_external_bench_quick(tool):
    """tools/external_bench.py --quick: the learner with external clients (examples/external_client.py,
    the C client) against local simulators, each run to the stop return, every process stopped."""
    rc, out, err = tool("external_bench.py", "--quick", "--json", "--kinds", "local", "python", "c", timeout=240)
    assert rc == 0, err[-3000:]
    r = last_json(out)
    check_common(r, "external_bench")
    assert r["params"]["clients"] == [2] and r["params"]["stop_return"] == 100.0
    assert [(run["kind"], run["n"], run["exit"], run["solved"]) for run in r["runs"]] == \
        [("local", 2, 0, True), ("python", 2, 0, True), ("c", 2, 0, True)]
    assert all(run["return_mean"] >= 100 and positive(run["env_steps"]) for run in r["runs"])
    local = r["summary"]["local/2"]["median_env_steps"]
    assert r["summary"]["python/2"]["env_steps_vs_local"] == round(r["runs"][1]["env_steps"] / local, 2)


def test_bench_sync_quick(tool):
    rc, out, err = tool("bench.py", "sync", "--quick", "--json", timeout=120)
    assert rc == 0, err[-3000:]
    r = last_json(out)
    check_common(r, "sync")
    for key in ("all_simulators_ms", "first_simulator_ms", "publish_ms", "install_alone_ms"):
        assert positive(r[key]["median"]) and r[key]["p90"] >= r[key]["median"], key
    assert set(r["publish_parts_ms"]) == {"onnx", "encode", "set_state"}
    assert all(positive(x["median"]) for x in r["publish_parts_ms"].values())
    # The last simulator's message comes no sooner than the first's, and both after the publish.
    assert r["all_simulators_ms"]["median"] >= r["first_simulator_ms"]["median"] > r["publish_ms"]["median"]
    assert positive(r["onnx_file_bytes"])


def test_bench_memory_quick(tool):
    rc, out, err = tool("bench.py", "memory", "--quick", "--json", timeout=180)
    assert rc == 0, err[-3000:]
    r = last_json(out)
    check_common(r, "memory")
    procs = r["processes"]
    roles = sorted(x["role"] for x in procs)
    assert roles.count("learner") == 1 and roles.count("fork server") == 1, roles
    assert [x for x in roles if x.startswith("simulator ")] == ["simulator 0", "simulator 1"], roles
    for x in procs:
        assert positive(x["pss_mib"]) and positive(x["uss_mib"]) and positive(x["rss_mib"]), x
        # USS <= PSS <= RSS (status and smaps_rollup are read a moment apart: 1 MiB of slack).
        assert x["uss_mib"] <= x["pss_mib"] + 1e-6 and x["pss_mib"] <= x["rss_mib"] + 1.0, x
    for m in ("pss", "uss", "rss"):
        assert r[f"{m}_total_mib"] == pytest.approx(sum(x[f"{m}_mib"] for x in procs))
    # Shared pages (libraries, the simulators' pages shared with their fork server) are
    # counted whole by RSS in every process, a share each by PSS, not at all by USS.
    assert r["uss_total_mib"] < r["pss_total_mib"] < r["rss_total_mib"]
    sims = r["by_role"]["simulator"]
    assert sims["processes"] == 2 and sims["pss_mib"] == pytest.approx(
        sum(x["pss_mib"] for x in procs if x["role"].startswith("simulator ")))
    assert r["per_simulator_mib"] == {m: sims[f"{m}_per_process_mib"] for m in ("pss", "uss", "rss")}
    assert r["by_role"]["learner"]["processes"] == 1
    (run,) = r["runs"]
    assert run["exit_code"] == 130 and run["shm_files_left"] == []     # stopped as after Ctrl-C, clean
    assert positive(r["first_sample_s"]) and positive(r["first_progress_s"]) and positive(r["first_update_train_s"])
    # The start-up's split: torch's import began at the run's start, beside the simulators' first
    # steps, and the first update came after it ended (whether the import began before the first
    # sample arrived is the machine's load's to decide: not asserted).
    started, ended = r["torch_import_started_s"], r["torch_import_ended_s"]
    assert 0 <= started < ended <= r["first_update_elapsed_s"], r
    assert 0 <= r["torch_import_waited_s"] <= ended + 0.05   # the run cannot wait for it past its end (clocks apart)


def test_bench_update_quick(tool):
    """bench.py update --quick: every preset network's update through the learner's code
    path, timed part by part (tiny batches, one update each)."""
    from tools.update_bench import CASE_NAMES, PARTS

    rc, out, err = tool("bench.py", "update", "--quick", "--json", timeout=180)
    assert rc == 0, err[-3000:]
    r = last_json(out)
    assert r["subcommand"] == "update" and len(r["method"]) > 100 and r["params"]["device"] == "cpu"
    assert [x["net"] for x in r["nets"]] == list(CASE_NAMES)
    for x in r["nets"]:
        assert set(x["ms"]) == set(PARTS) and all(positive(v) for v in x["ms"].values()), x
        assert x["total_ms"] == pytest.approx(sum(x["ms"].values()))
        assert x["gradient_steps"] >= 1 and positive(x["per_gradient_step_ms"]) and positive(x["weights"])
        assert x["per_gradient_step_ms"] == pytest.approx(x["ms"]["update"] / x["gradient_steps"])
        assert positive(x["make_batch_values_ms"]) if x.get("algo") != "sac" else x["make_batch_values_ms"] is None
    nets = {x["net"]: x for x in r["nets"]}
    assert nets["sac-mlp256"]["gradient_steps"] == 128 and nets["sac-mlp256"]["settings"]["hidden"] == 256
    assert nets["mlp64-mb64"]["settings"]["minibatch_size"] == 64 and nets["mlp256"]["settings"]["hidden"] == 256
    assert nets["lstm"]["settings"]["memory"] == "lstm"


def test_bench_scaling_quick(tool, tmp_path):
    """bench.py scaling --quick: one short shmrl.run (CartPole, --sims 1, a 4096-step budget)
    read back from its own summary.json into a point, with the plot where matplotlib is."""
    import importlib.util

    from tools.scaling_bench import default_sims

    assert default_sims(16) == [1, 2, 4, 8, 16] and default_sims(2) == [1, 2] and default_sims(1) == [1]
    assert default_sims(6) == [1, 2, 4, 6]
    plot = tmp_path / "scaling.png"
    with_plot = importlib.util.find_spec("matplotlib") is not None
    rc, out, err = tool("bench.py", "scaling", "--quick", "--json", *(["--plot", plot] if with_plot else []),
                        timeout=240)
    assert rc == 0, err[-3000:]
    r = last_json(out)
    assert r["subcommand"] == "scaling" and len(r["method"]) > 100 and r["torch_imported"] is False
    assert r["params"]["envs"] == ["CartPole-v1"] and r["params"]["sims"] == [1] and r["params"]["seeds"] == [0]
    assert r["params"]["max_env_steps"] == 4096 and r["params"]["usable_cores"] == len(os.sched_getaffinity(0))
    assert r["host_before"]["cpus"] >= 1 and len(r["host_after"]["loadavg"]) == 3 and r["torch"]
    [run] = r["runs"]
    assert (run["env"], run["sims"], run["seed"]) == ("CartPole-v1", 1, 0) and run["exit"] in (0, 1)
    assert run["target"] == 475 and run["updates"] >= 1
    assert run["env_steps"] >= 4096 and positive(run["env_steps_per_s"]) and positive(run["wall_s"])
    assert 0 <= run["learner_share"] <= 1
    # The run's rate counts from its serving's start: after the process started, before its first env steps.
    serving_s = run["env_steps"] / run["env_steps_per_s"]
    assert run["wall_s"] - run["first_sample_s"] - 0.5 <= serving_s <= run["wall_s"] * 1.01 + 0.1
    assert run["reached"] == (run["exit"] == 0) and (run["seconds"] is None) == (not run["reached"])
    if run["reached"]:   # CartPole solved in 4096 steps: not expected, but then the time is the run's
        assert 0 < run["seconds"] <= run["wall_s"]
    [p] = r["points"]
    assert (p["env"], p["sims"], p["seeds"], p["reached"]) == ("CartPole-v1", 1, 1, int(run["reached"]))
    assert p["env_steps_per_s_median"] == run["env_steps_per_s"] and p["learner_share_median"] == run["learner_share"]
    assert p["seconds_median"] == run["seconds"]
    if with_plot:
        assert r["plot"] == str(plot) and plot.stat().st_size > 1000
    else:
        assert r["plot"] is None


def test_gpu_check_quick(tool):
    """tools/gpu_check.py --quick: on a machine without a GPU it says so and exits 0; with
    one, every check passes."""
    import torch

    rc, out, err = tool("gpu_check.py", "--quick", "--json", timeout=300)
    assert rc == 0, err[-3000:]
    r = last_json(out)
    assert r["subcommand"] == "gpu_check" and r["ok"] is True and r["gpu"] == torch.cuda.is_available()
    if not r["gpu"]:
        assert r["checks"] == r["resumes"] == r["times"] == []
        rc, out, err = tool("gpu_check.py", "--quick", timeout=120)
        assert rc == 0 and out.startswith("gpu_check: no CUDA GPU here"), (out, err[-3000:])
    else:
        assert all(x["ok"] for x in r["checks"] + r["resumes"]) and len(r["times"]) == len(r["checks"])


def test_solve_quick(tool):
    rc, out, err = tool("solve.py", "--quick", "--json", timeout=180)
    assert rc == 0, err[-3000:]
    r = last_json(out)
    assert r["command"].endswith("--stop-return 100")
    (run,) = r["runs"]
    assert run["seed"] == 0 and run["exit"] == 0 and run["solved"] is True and run["return_mean"] >= 100
    assert positive(run["env_steps"]) and positive(run["wall_s"]) and r["all_solved"] is True


def test_a_run_gets_ctrl_c_even_when_the_tool_was_started_ignoring_sigint():
    """A background job of a script (``nohup python tools/solve.py &``) starts with SIGINT
    ignored, and so would every Python it starts: interrupt_group's Ctrl-C then did nothing,
    and a run past its --timeout ended only by the SIGKILL 15 s later."""
    child = ("import time\ntry:\n    print('ready', flush=True); time.sleep(120)\n"
             "except KeyboardInterrupt:\n    raise SystemExit(130)\n")
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc = shared.popen_group([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        assert proc.stdout.readline() == "ready\n"            # in its try: Ctrl-C now raises there
        assert shared.interrupt_group(proc, timeout=30) == 130   # not -9, the SIGKILL 30 s later
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()


def test_solve_stops_a_run_that_outlives_its_timeout(tool):
    """A run past --timeout is stopped with its simulators and shared memory (the fixture
    checks), and counts as not solved."""
    rc, out, err = tool("solve.py", "--quick", "--json", "--timeout", "2", "--", "--stop-return", "1e9",
                        timeout=60)
    assert rc == 1, err[-3000:]
    (run,) = last_json(out)["runs"]
    assert run["solved"] is False and run["exit"] is None and run["env_steps"] is None


@pytest.mark.slow   # a harness (tests/harness/abuse.py): a whole run under abuse
def test_abuse_quick(tool):
    rc, out, err = tool("tests.harness.abuse", "--quick", "--json", timeout=180)
    assert rc in (0, 1), err[-3000:]                # 1: a gate failed on a loaded machine, still a report
    r = last_json(out)
    assert r["subcommand"] == "abuse" and r["ok"] == (rc == 0) and r["torch_imported"] is False
    assert r["params"]["rounds"] == 1 and r["params"]["max_frame_bytes"] == 4 << 20
    for kind in ("PING", "GET_STATE", "EPISODES_AND_GET_STATE"):
        s = r["summary"][kind]
        assert set(s) == {"unloaded", "abused", "after"}, s            # no line-rate windows in quick
        assert positive(s["unloaded"]["median_ms"]) and positive(s["abused"]["median_ms"])
        assert s["abused"]["ratio"] == pytest.approx(s["abused"]["median_ms"] / s["unloaded"]["median_ms"])
    (rnd,) = r["rounds"]
    assert rnd["windows"]["abused"]["PING"]["n"] > 0 and rnd["windows"]["unloaded"]["PING"]["n"] > 0
    abusers = rnd["abusers"]["abused"]
    assert abusers["idle_open_at_end"] == 20                          # idle connections are never dropped
    # The endless client's 4 MiB frame ends as invalid JSON: dropped, and back for more.
    endless = r["drops_by_window_and_role"]["abused"]["endless"]
    assert endless["reasons"].get("invalid JSON at the end of the body", 0) >= 1, endless
    assert abusers["endless"]["connections"] >= 2 and positive(abusers["endless"]["bytes_sent"])
    m = r["memory"]
    assert positive(m["rss_before_mib"]) and m["rss_peak_mib"] >= m["rss_before_mib"] and positive(m["rss_after_mib"])
    c = r["cleanup"]
    assert c["server_exit_code"] == 143 and c["shm_files_left"] == [] and c["server_group_alive"] is False


@pytest.mark.slow   # a harness (tests/harness/abuse_messages.py): a whole run under hostile messages
def test_abuse_messages_quick(tool):
    rc, out, err = tool("tests.harness.abuse_messages", "--quick", "--json", timeout=180)
    assert rc in (0, 1), err[-3000:]                # 1: a gate failed on a loaded machine, still a report
    r = last_json(out)
    assert list(r["rows"]) == ["quiet", "busy", "empty", "surrogate", "agent-ids"]
    assert r["ok"] == (rc == 0)
    for name, row in r["rows"].items():
        assert positive(row["rtt_ms"]["PING"]) and row["rss_peak_mib"] >= row["rss_before_mib"] > 0
        if name not in ("quiet", "busy"):
            assert row["run_alive"], name
    assert r["rows"]["surrogate"]["attacker"]["closed"] >= 1        # a wrong token: closed, and back for more
    assert r["rows"]["empty"]["attacker"]["replies"] >= 1            # an empty EPISODES_AND_GET_STATE is answered


def test_processes_quick(tool):
    rc, out, err = tool("processes.py", "--quick", "--json", timeout=180)
    assert rc == 0, err[-3000:]
    r = last_json(out)
    roles = sorted(p["role"] for p in r["processes"])
    assert roles[:2] == ["fork server", "learner"] and roles.count("simulator 0") == roles.count("simulator 1") == 1
    assert all(positive(p["pss_mib"]) and p["rss_mib"] >= p["uss_mib"] for p in r["processes"])
    assert r["pss_mib"] == pytest.approx(sum(p["pss_mib"] for p in r["processes"]))
    assert r["updates"] >= 1 and r["summary_written"]                # stopped as after Ctrl-C: it wrote its summary
    assert r["exit_status"] == 130 and r["group_left"] is False and r["shm_left"] == []


@pytest.mark.slow   # among the suite's longest (25-40 s)
@pytest.mark.skipif(not SB3_PYTHON.exists(), reason="no stable-baselines3 virtualenv: `python tools/sb3_baseline.py "
                                                    "--setup` makes it (.ci/run does, before the tests)")
def test_sb3_baseline_quick(tool):
    rc, out, err = tool("sb3_baseline.py", "--quick", "--json", timeout=300)
    assert rc == 0, err[-3000:]
    r = last_json(out)
    assert "--stop-return 100.0" in r["shmrl_command"] and "--max-env-steps 50000" in r["shmrl_command"]
    for who in ("sb3", "shmrl"):
        assert r[who]["solved"] == r[who]["of"] == 1, r[who]
        (run,) = r["runs"][who]
        assert run["seed"] == 0 and run["solved"] is True and run["return_mean"] >= 100, run
        # At most a batch past the budget.
        assert 0 < run["env_steps"] <= 50_000 + 2048 and positive(run["wall_s"]), run
        assert r[who]["median_wall_s"] == run["wall_s"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow   # among the suite's longest (25-40 s)
@pytest.mark.skipif(not RLLIB_PYTHON.exists(), reason="no RLlib 2.48 virtualenv: `python tools/rllib_compat.py "
                                                      "--setup` makes it (.ci/run does, before the tests)")
def test_rllib_client_against_shmrl_quick(tool):
    """RLlib 2.48's own _dummy_client trains shmrl's learner over TCP to a mean return of 100."""
    port = free_port()
    rc, out, err = tool("rllib_compat.py", "client", "--port", port, "--quick", "--json", timeout=300)
    r = last_json(out)
    assert rc == 0, (r.get("failure"), r.get("shmrl_log_tail"), r.get("client_log_tail"), err[-2000:])
    assert r["mode"] == "client" and r["solved"] is True and r["exit_status"] == 0 and r["port"] == port
    assert r["return_mean"] >= 100 and positive(r["episodes"]) and positive(r["updates"])
    assert 0 < r["env_steps_trained"] <= r["env_steps"] <= 100_000 + 4096
    assert positive(r["wall_s"]) and positive(r["peak_rss_mb"])
    assert "survivors" not in r and r["scratch"] is None                 # every process stopped, scratch removed


@pytest.mark.slow   # among the suite's longest (25-40 s)
def test_multiagent_bench_quick(tool):
    rc, out, err = tool("multiagent_bench.py", "--quick", "--json", timeout=180)
    assert rc == 0, err[-2000:]
    r = json.loads(out)
    assert r["quick"] is True
    c4 = r["connect_four"]
    run = c4["runs"][0]
    assert run["seed"] == 0 and run["exit"] == 1 and run["env_steps"] >= 8192 and run["games"] == 50
    assert 0 <= run["win_rate_greedy"] <= 1 and 0 <= run["win_rate_sampled"] <= 1
    # The preset as a user runs it, evaluated while it trains (--quick: every update, 20 games).
    assert "--env pz:connect_four_v3 --seed S --max-env-steps 8192" in c4["command"]
    assert run["evaluations"] == run["updates"] >= 1 and 0 <= run["train_win_rate"] <= 1
    assert 1 <= run["train_win_rate_update"] <= run["updates"] and run["stop_win_rate"] <= 1
    assert run["wall_s"] > run["train_wall_s"] > 0 and c4["target"] == {"win_rate": 0.9, "wall_s": 300.0}
    assert run["met"] == (run["win_rate_greedy"] >= 0.9 and run["wall_s"] <= 300)
    spread = r["simple_spread"]
    run = spread["runs"][0]
    assert run["exit"] == 1 and run["env_steps"] >= 13000 and run["return_mean"] < 0
    assert run["return_at_target_s"] < 0   # the last progress row within the 600 s
    assert sorted(run["return_by_agent"]) == ["agent_0", "agent_1", "agent_2"]
    assert spread["target"]["wall_s"] == 600.0 and run["met"] == (run["reached_s"] is not None
                                                                  and run["reached_s"] <= 600)


@pytest.mark.slow   # over 10 s: trains to a target or runs a whole tool
def test_inference_bench_quick(tool):
    """tools/inference_bench.py: server-side inference's env steps/s and ACT's round trip
    at each client count, beside client-side inference's steps/s."""
    rc, out, err = tool("inference_bench.py", "--quick", "--json", timeout=180)
    assert rc == 0, err[-3000:]
    r = last_json(out)
    assert [p["clients"] for p in r["server_side"]] == [p["clients"] for p in r["client_side"]] == [1, 2]
    for point in r["server_side"]:
        assert positive(point["env_steps_per_s"]) and point["rtt_samples"] > 0, point
        assert 0 < point["rtt_ms_p50"] <= point["rtt_ms_p99"], point
    assert all(positive(p["env_steps_per_s"]) for p in r["client_side"]), r
    assert len(r["loadavg_before"]) == 3 and "server-inference" in r["client_cmd"]
    last = r["server_side"][-1]
    assert 0 < last["client_steps_min"] <= last["client_steps_max"] and positive(last["server_rss_mb"]), last
    # each env step counted once: the rate over the window is what the two clients stepped in it
    stepped = last["client_steps_min"] + last["client_steps_max"]
    assert 0.8 < last["env_steps_per_s"] * 1.5 / stepped < 1.25, last
    assert positive(last["server_cpu_us_per_step"]), last


@pytest.mark.slow   # a harness (tests/harness/readme_commands.py)
def test_the_readme_commands_harness_runs_each_command_quickly():
    """tests/harness/readme_commands.py --quick: every command of the README parses (its --help), and
    its Python block compiles, in a copy of the repository."""
    proc = subprocess.run([sys.executable, "-m", "tests.harness.readme_commands", "--quick"], cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "$ python -m shmrl.run --sims 8 --max-env-steps 4000 --help" in proc.stdout
    assert "all README commands ran" in proc.stdout


def test_the_readme_harness_keeps_a_clients_only_learner_whole_and_checks_every_client_took_part(tmp_path):
    """tests/harness/readme_commands.py's rules for the README's external-client block,
    without running it: a learner with --sims 0 keeps its budget (a short one could end
    the run before its clients all joined), and a block in which a client sent no env step
    fails, naming the clients and what the summary counted."""
    from harness import readme_commands as harness

    assert harness.shorten("python -m shmrl.run --sims 8") == "python -m shmrl.run --sims 8 --max-env-steps 4000"
    assert harness.shorten("python -m shmrl.run --sims 0 --tcp-port 5556") == "python -m shmrl.run --sims 0 --tcp-port 5556"
    readme = (REPO / "README.md").read_text()
    (block,) = [b for b in harness.blocks(readme, "bash") if "examples/external_client.py" in b]
    lines = harness.commands(block, 6000)
    learners = [line for line in lines if harness.serves_clients(line)]
    assert len(learners) == 1 and "--sims 0" in learners[0] and len(lines) == 3, lines
    run = tmp_path / "runs" / "CartPole-v1-1"
    run.mkdir(parents=True)

    def took_part(by_client: dict) -> list[str]:
        (run / "summary.json").write_text(json.dumps({"env_steps_by_client": by_client}))
        return harness.clients_took_part(lines, {run})

    assert took_part({"tcp:127.0.0.1:40001": 9000, "tcp:127.0.0.1:40002": 2048}) == []
    (failure,) = took_part({"tcp:127.0.0.1:40001": 11000, "shm:0": 4000})   # the run: one never joined
    assert "2 clients started" in failure and "1 TCP connections only" in failure, failure


@pytest.mark.slow
def test_the_readme_commands_run_as_written_with_short_budgets():
    proc = subprocess.run([sys.executable, "-m", "tests.harness.readme_commands"], cwd=REPO, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow   # over 10 s: trains to a target or runs a whole tool
def test_slow_sims_quick(tool):
    """tools/slow_sims.py --quick without SB3: shmrl on a throttled MuJoCo env, its curve
    and how busy its learner was (SB3 beside it: tests/test_adapt.py, slow)."""
    pytest.importorskip("mujoco", reason="the mujoco extra is not installed (the test extra has it)")
    rc, out, err = tool("slow_sims.py", "--quick", "--no-sb3", "--json", timeout=180)
    assert rc == 0, err[-3000:]
    r = last_json(out)
    (run,) = r["envs"]["InvertedPendulum-v5"]["runs"]
    shmrl = run["shmrl"]
    assert shmrl["env_steps"] >= 5000 and shmrl["curve"]
    assert shmrl["env_steps_per_s"] <= r["rate"] * 1.2   # throttled: at most the rate, with a little slack
    learner = shmrl["learner"]
    assert 0 < learner["learner_share_median"] < 1 and learner["approx_kl_max"] < 1 and learner["learn_levels"]


@pytest.mark.slow   # over 10 s: trains to a target or runs a whole tool
def test_slow_sims_quick_sac_in_parts(tool, tmp_path):
    """tools/slow_sims.py --algo sac --quick without SB3: shmrl's SAC on a throttled Pendulum,
    its replay ratio; with --results the seed's file is written, read back by a second
    sitting instead of running again, and refused under other settings."""
    pytest.importorskip("gymnasium")
    results = tmp_path / "parts"
    args = ("slow_sims.py", "--quick", "--algo", "sac", "--no-sb3", "--json", "--results", results)
    rc, out, err = tool(*args, timeout=240)
    assert rc == 0, err[-3000:]
    (run,) = last_json(out)["envs"]["Pendulum-v1"]["runs"]
    learner = run["shmrl"]["learner"]
    assert learner["algo"] == "sac" and learner["grad_steps"] > 0 and 0 < learner["replay_ratio_median"] <= 1.5
    assert [f.name for f in results.iterdir()] == ["Pendulum-v1-sac-seed0.json"]
    rc, out, err = tool(*args, timeout=60)
    assert rc == 0 and "read from" in err and last_json(out)["envs"]["Pendulum-v1"]["runs"] == [run], err[-3000:]
    rc, out, err = tool(*args, "--", "--hidden", "64", timeout=60)   # other settings: its file is not theirs
    assert rc != 0 and "was measured with" in err and "Traceback" not in err, err[-3000:]


@pytest.mark.slow   # over 10 s: trains to a target or runs a whole tool
def test_record_bench_overhead_quick(tool, tmp_path):
    """tools/record_bench.py overhead --quick, as a command: CartPole with and without
    --record, each to its short budget, and the cost of recording."""
    rc, out, err = tool("record_bench.py", "overhead", "--quick", "--json", "--workdir", tmp_path / "work", timeout=240)
    assert rc == 0, err[-3000:]
    result = last_json(out)
    assert all(r["exit"] == 1 and r["env_steps"] >= 4000 for v in result["runs"].values() for r in v)
    assert result["record_cost_pct"] is not None


@pytest.mark.slow
def test_record_bench_pretrain_quick(tool, tmp_path):
    """tools/record_bench.py pretrain --quick: an expert, its recording, and a run from scratch
    beside one from --pretrain (~30 s)."""
    rc, out, err = tool("record_bench.py", "pretrain", "--quick", "--json", "--workdir", tmp_path / "work", timeout=300)
    assert rc == 0, err[-3000:]
    result = last_json(out)
    assert result["dataset"]["whole_episodes"] >= 5 and result["expert_return"] >= 60
    assert {r["exit"] for v in result["runs"].values() for r in v} <= {0, 1}
    assert result["env_steps_ratio"] > 0 and result["wall_ratio"] > 0


def test_a_tool_runs_as_its_file_from_any_folder_and_as_a_module(tmp_path):
    """``python tools/solve.py`` from another folder goes through tools/run_as_module.py and
    runs as tools.solve; ``python -m tools.solve`` from the root does the same directly."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(REPO)}
    as_file = subprocess.run([sys.executable, str(TOOLS / "solve.py"), "--help"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=60)
    as_module = subprocess.run([sys.executable, "-m", "tools.solve", "--help"], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=60)
    for proc in (as_file, as_module):
        assert proc.returncode == 0 and "--seeds" in proc.stdout, proc.stderr[-3000:]


def test_group_alive_counts_live_processes_not_zombies():
    """tools.shared.group_alive: a group whose only member has exited but is not reaped yet
    (a zombie, as a run's fork server is until init reaps it) is gone; a sleeping one is not.
    The tools time a run to its exit and wait for its group only to clean up."""
    import subprocess
    import sys
    import time

    from tools.shared import group_alive

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    done = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while open(f"/proc/{done.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.01)
        assert not group_alive(done.pid)       # exited, not reaped: not alive
        assert group_alive(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait(10)
        done.wait(10)
    assert not group_alive(sleeper.pid)
