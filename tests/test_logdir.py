"""The log folder holds: one writer at a time, whole lines, a resume that cuts the metrics
back to its checkpoint, JSON without bare NaN, and a full disk that ends in one line."""
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from shmrl.files import logdir
from shmrl.config.settings import ConfigError
from shmrl.files.metrics import MetricsLog


def test_a_second_lock_is_refused_naming_the_holder(tmp_path):
    with logdir.take_lock(tmp_path):
        with pytest.raises(ConfigError, match=rf"--resume {tmp_path}: another run \(pid {os.getpid()}\) is writing "
                                              rf"there"):
            logdir.take_lock(tmp_path, "--resume")
    with logdir.take_lock(tmp_path):   # released: free again
        pass
    assert (tmp_path / logdir.LOCK_FILE).read_text() == ""   # a clean release names no pid


def test_the_lock_dies_with_its_process_and_is_taken_over_with_a_message(tmp_path, caplog):
    """kill -9 cannot release anything: the kernel drops the flock, the pid stays in the
    file, and the next run says whose lock it took over."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from shmrl.files import logdir
        lock = logdir.take_lock({str(tmp_path)!r})
        print("locked", flush=True)
        time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=rf"another run \(pid {holder.pid}\) is writing there"):
            logdir.take_lock(tmp_path)
    finally:
        holder.kill()
        holder.wait(10)
        holder.stdout.close()
    with caplog.at_level("WARNING", logger="shmrl.run"):
        lock = logdir.take_lock(tmp_path)
    try:
        assert f"taking over the lock of pid {holder.pid}" in caplog.text
        assert (tmp_path / logdir.LOCK_FILE).read_text().strip() == str(os.getpid())
    finally:
        lock.release()


def test_non_finite_floats_are_written_as_null_at_any_depth(tmp_path):
    row = {"return_mean": math.nan, "x": [math.inf, 1.5], "by": {"a": -math.inf, "b": 2}, "n": 3, "ok": True}
    text = logdir.dumps(row)
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"return_mean": None, "x": [None, 1.5], "by": {"a": None, "b": 2}, "n": 3, "ok": True}
    logdir.write_json_file(tmp_path / "summary.json", row)
    assert json.loads((tmp_path / "summary.json").read_text())["return_mean"] is None
    metrics = MetricsLog(tmp_path)
    metrics.write({"update": 1, **row})
    metrics.close()
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl"))["return_mean"] is None


def test_read_rows_drops_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"update": 1}\n{"update": 2}\n\x00\x00\x00\n{"update": 3, "ret')
    assert logdir.read_rows(path) == [{"update": 1}, {"update": 2}]


def test_cut_rows_keeps_updates_up_to_the_checkpoint_unique_and_increasing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    # A run to 5, killed; main's old resume from 3 wrote 4 and 5 again; then a torn line.
    lines = [{"update": u, "env_steps_trained": 100 * u} for u in (1, 2, 3, 4, 5, 4, 5, 6)]
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in lines) + b'{"update": 7, "env_st')
    assert logdir.cut_rows(path, 5) == 4   # the first 4 and 5, 6 and the torn line
    rows = logdir.read_rows(path)
    assert [r["update"] for r in rows] == [1, 2, 3, 4, 5]
    assert path.read_bytes().endswith(b"\n") and not list(tmp_path.glob(".*writing"))
    before = path.stat().st_mtime_ns
    assert logdir.cut_rows(path, 5) == 0 and path.stat().st_mtime_ns == before   # nothing to cut: untouched
    assert logdir.cut_rows(tmp_path / "none.jsonl", 3) == 0


def test_a_line_without_its_newline_is_completed_before_appending(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"update": 1}\n{"update": 2}')
    assert logdir.cut_rows(path, 2) == 0
    metrics = MetricsLog(tmp_path, append=True)
    metrics.write({"update": 3})
    metrics.close()
    assert [r["update"] for r in logdir.read_rows(path)] == [1, 2, 3]


def test_a_full_disk_leaves_whole_lines_and_the_old_summary(small_disk):
    metrics = MetricsLog(small_disk)
    row = {"update": 0, "pad": "x" * 3000}
    with pytest.raises(logdir.LogdirWriteError, match=r"cannot write .*metrics.jsonl: No space left on device"):
        for update in range(1, 1000):
            metrics.write({**row, "update": update})
    metrics.close()
    rows = logdir.read_rows(small_disk / "metrics.jsonl")
    assert len(rows) > 10 and (small_disk / "metrics.jsonl").read_bytes().endswith(b"\n")   # no torn line
    assert [r["update"] for r in rows] == list(range(1, len(rows) + 1))
    os.truncate(small_disk / "metrics.jsonl", 0)   # room again for a small summary, not for a large one
    logdir.write_json_file(small_disk / "summary.json", {"old": True})
    with pytest.raises(logdir.LogdirWriteError, match=r"cannot write .*summary.json: No space left on device"):
        logdir.write_json_file(small_disk / "summary.json", {"pad": "y" * 400_000})
    assert json.loads((small_disk / "summary.json").read_text()) == {"old": True}
    assert sorted(os.listdir(small_disk)) == ["metrics.jsonl", "summary.json"]


def test_plot_takes_null_returns(tmp_path):
    """Rows before the first episode have a null return_mean (NaN in runs of older shmrl),
    a run without a stop return a null one in summary.json's config."""
    from shmrl import plot

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"update": 1, "return_mean": None, "env_steps": 100, "elapsed_s": 1.0},
            {"update": 2, "return_mean": 12.5, "env_steps": 200, "elapsed_s": 2.0}]
    (run / "metrics.jsonl").write_text("".join(logdir.dumps(r) + "\n" for r in rows)
                                       + '{"update": 3, "return_mean": NaN, "env_steps": 300, "elapsed_s": 3.0}\n')
    logdir.write_json_file(run / "summary.json", {"config": {"stop_return": math.inf}})
    assert plot.main([str(run), "-o", str(tmp_path / "curves.png")]) == 0
    assert (tmp_path / "curves.png").stat().st_size > 1000


def test_eval_of_a_nan_policy_is_an_error_not_a_return(tmp_path):
    import numpy as np

    from shmrl.onnxio.policy import OnnxPublisher

    z = np.zeros
    weights = [z((2, 4)), z(2), z((2, 2)), z(2), z((2, 2)), np.array([0.0, np.nan])]   # a NaN logit
    (tmp_path / "policy.onnx").write_bytes(OnnxPublisher([4, 2, 2, 2]).publish(weights))
    proc = subprocess.run([sys.executable, "-m", "shmrl.eval", tmp_path / "policy.onnx", "--env", "CartPole-v1",
                           "--episodes", "3"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", (proc.stdout, proc.stderr)
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path}/policy.onnx: the policy outputs NaN or infinity (a NaN in its weights?): "
        "no return to report"]


# ---------------------------------------------------------------- whole runs

def run_once(*args, cwd, timeout=120) -> subprocess.CompletedProcess:
    """``python -m shmrl.run ARGS`` to its end (a run refused at start ends at once)."""
    return subprocess.run([sys.executable, "-m", "shmrl.run", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def check_metrics(logdir_path, summary: dict) -> list[dict]:
    """metrics.jsonl parses line by line, update numbers are unique and increasing, no
    counter goes backwards, and summary.json agrees with it."""
    lines = (logdir_path / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]   # every line, no torn one
    assert [r["update"] for r in rows] == list(range(1, len(rows) + 1)), [r["update"] for r in rows]
    for key in ("env_steps", "env_steps_trained", "episodes", "weights_seq_no"):
        values = [r[key] for r in rows]
        assert values == sorted(values), (key, values)
    assert summary["updates"] == rows[-1]["update"]
    assert summary["env_steps_trained"] == sum(r["batch_steps"] for r in rows)
    return rows


QUICK = ("--sims", 2, "--env-steps-per-sample", 256, "--train-batch-size", 512, "--hidden", 16,
         "--no-tensorboard", "--log-every", 0)


def test_a_second_run_and_a_resume_on_a_live_runs_folder_are_refused(start_run, tmp_path):
    logs = tmp_path / "logs"
    first = start_run(*QUICK, "--stop-return", 1e9, "--max-env-steps", 10_000_000, "--checkpoint-every", 1,
                      "--logdir", logs)
    first.wait_for("update    3 |", timeout=90)
    for args, flag in [(("--sims", 1, "--logdir", logs, "--max-env-steps", 2000), "--logdir"),   # (short if it ran)
                       (("--resume", logs, "--max-env-steps", 10_000_000), "--resume")]:
        proc = run_once(*args, "--no-tensorboard", cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert error_lines(proc) == [f"error: {flag} {logs}: another run (pid {first.proc.pid}) is writing there; "
                                     f"let it end or stop it first, or choose another folder"], proc.stderr
        assert "Traceback" not in proc.stderr
    first.proc.send_signal(2)   # Ctrl-C: the first run ends as it would have
    first.proc.wait(timeout=60)
    assert first.proc.returncode == 130, first.output()
    check_metrics(logs, json.loads((logs / "summary.json").read_text()))
    assert "resuming from" not in first.output()


def test_kill_9_then_resume_keeps_metrics_and_summary_consistent(start_run, tmp_path):
    logs = tmp_path / "logs"
    first = start_run(*QUICK, "--stop-return", 1e9, "--max-env-steps", 10_000_000, "--checkpoint-every", 3,
                      "--logdir", logs)
    first.wait_for("update    4 |", timeout=90)
    first.kill()   # SIGKILL to the whole process group: no summary, no final checkpoint
    with open(logs / "metrics.jsonl", "ab") as f:   # and as if the kill had come in the middle of a line
        f.write(b'{"update": 99, "env_steps_trai')
    rows_before = logdir.read_rows(logs / "metrics.jsonl")
    checkpoints = sorted(p.name for p in (logs / "checkpoints").iterdir() if p.name.isdigit())
    if int(checkpoints[-1]) >= rows_before[-1]["update"]:   # the kill came late: as if before that rename
        shutil.rmtree(logs / "checkpoints" / checkpoints.pop())
    assert rows_before[-1]["update"] > int(checkpoints[-1])   # rows past the newest checkpoint to cut
    proc = run_once(*QUICK, "--resume", logs, "--max-env-steps", rows_before[-1]["env_steps"] + 3000,
                    cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"resuming from {logs}/checkpoints/{checkpoints[-1]}" in proc.stdout
    assert f"taking over the lock of pid {first.proc.pid}" in proc.stderr
    summary = json.loads((logs / "summary.json").read_text())
    rows = check_metrics(logs, summary)
    assert rows[-1]["update"] > rows_before[-1]["update"] and summary["resumed_from"]


def test_a_resume_with_another_network_is_refused_naming_the_setting(tmp_path):
    logs = tmp_path / "logs"
    done = run_once(*QUICK, "--max-env-steps", 1500, "--logdir", logs, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    before = {p: p.stat().st_mtime_ns for p in [logs / "policy.onnx", *logs.glob("checkpoints/*/*")]}
    proc = run_once("--resume", logs, "--activation", "Tanh", "--max-env-steps", 5000, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert error_lines(proc) == [f"error: --resume {logs}: --activation Tanh differs from the checkpoint's "
                                 f"--activation ReLU; a run resumes with the network it was trained with"]
    assert {p: p.stat().st_mtime_ns for p in before} == before


def test_a_resume_whose_budget_is_spent_trains_nothing(tmp_path):
    logs = tmp_path / "logs"
    done = run_once(*QUICK, "--max-env-steps", 1500, "--logdir", logs, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    before = {p: p.read_bytes() for p in [logs / "metrics.jsonl", logs / "summary.json",
                                          *logs.glob("checkpoints/*/*")]}
    steps = json.loads((logs / "summary.json").read_text())["env_steps"]
    proc = run_once("--resume", logs, cwd=tmp_path, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"step budget exhausted: {logs} already has {steps} env steps (--max-env-steps 1500)" in proc.stdout
    assert "update" not in proc.stdout and "Traceback" not in proc.stderr
    assert {p: p.read_bytes() for p in before} == before   # no checkpoint, metrics or summary rewritten


def test_a_full_disk_ends_the_run_with_one_error_line(small_disk, tmp_path):
    proc = run_once(*QUICK, "--stop-return", 1e9, "--max-env-steps", 10_000_000, "--checkpoint-every", 2,
                    "--logdir", small_disk, cwd=tmp_path, timeout=180)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = error_lines(proc)
    assert len(errors) == 1 and "No space left on device" in errors[0], proc.stderr
    from shmrl.files import checkpoint

    path, _, _, _ = checkpoint.load_latest(small_disk)   # the newest intact checkpoint is there
    rows = logdir.read_rows(small_disk / "metrics.jsonl")
    assert (small_disk / "metrics.jsonl").read_bytes().endswith(b"\n") and int(path.name) <= rows[-1]["update"]
    if (small_disk / "summary.json").exists():
        summary = json.loads((small_disk / "summary.json").read_text())
        assert summary["exit_status"] == 3 and "No space left on device" in summary["error"]
    else:
        assert "no summary.json" in errors[0]


def test_a_resume_with_another_policy_map_is_refused_naming_it(tmp_path):
    """Not the missing 'pi.0.w' of the shape check: the set of policies is compared first."""
    from pathlib import Path

    pytest.importorskip("pettingzoo", reason="the pettingzoo extra is not installed")
    logs = tmp_path / "multi"
    shutil.copytree(Path(__file__).parent / "data" / "main-ckpt-multi", logs)   # per-agent, connect four
    proc = run_once("--resume", logs, "--policy-map", "shared", "--max-env-steps", 10_000_000, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert error_lines(proc) == [f"error: --resume {logs}: --policy-map shared differs from the checkpoint's "
                                 f"--policy-map per-agent; a run resumes with the network it was trained with"]
