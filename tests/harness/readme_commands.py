"""Run the README's commands as a newcomer would, in a copy of the repository, with short
budgets: every command of its ```bash blocks, and its ```python block as a script. Its ```sh
block (building the C and JavaScript clients) is left to tests/test_c_client.py and
tests/test_js_client.py, which build and run them.

    python -m tests.harness.readme_commands            # each command for real (about 2 min on 2 cores)
    python -m tests.harness.readme_commands --quick    # each command's --help, the Python block compiled (seconds)

The copy holds the repository's files (tracked and untracked, as `git ls-files` lists
them), so it is what a fresh clone of this tree would hold; shmrl is imported from it
(PYTHONPATH), not from an install. Set-up lines (`git clone`, `pip install`) are not run.
A `python -m shmrl.run` line gets a tenth of its `--max-env-steps` (at least 2000), or
4000 where it gives none, except a learner with `--sims 0`: it trains on its block's
clients alone, and a short budget would end it before they had all joined, so it runs
as written. Port 5556 becomes a free one. A run may end solved (0) or out of budget (1);
every other command must exit 0. A line ending in `&` runs in the background until the
end of its block, and must end the same way. In a block whose learner serves TCP
clients (`--tcp-port`), every other command is a client, and each must have taken part:
the learner's summary.json counts env steps from as many TCP connections.

Exit status: 0 when every command ran as the README says, 1 otherwise (each failure is
printed with its output).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETUP = ("git clone", "pip install")


def blocks(readme: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", readme, flags=re.S)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shorten(command: str) -> str:
    """A shmrl.run command with a short budget (one with ``--sims 0`` as written: see above)."""
    if "shmrl.run" not in command or re.search(r"--sims 0\b", command):
        return command
    found = re.search(r"--max-env-steps (\d+)", command)
    if found:
        return command.replace(found.group(0), f"--max-env-steps {max(2000, int(found.group(1)) // 10)}")
    return command + " --max-env-steps 4000"


def commands(block: str, port: int) -> list[str]:
    """The block's command lines (comments and set-up lines left out), port 5556 replaced."""
    out = []
    for line in block.splitlines():
        line = line.split("  #")[0].strip()
        if line and not line.startswith("#") and not line.startswith(SETUP):
            detach = line.endswith("&")
            line = shorten(line.rstrip("&").strip().replace("5556", str(port)))
            out.append(line + (" &" if detach else ""))
    return out


def allowed(command: str) -> set[int]:
    return {0, 1} if "shmrl.run" in command else {0}


def serves_clients(command: str) -> bool:
    return "shmrl.run" in command and "--tcp-port" in command


def run_block(block: str, where: Path, env: dict, quick: bool, timeout: float) -> list[str]:
    """Run one block's commands in order; returns the failures."""
    failures, background = [], []
    lines = commands(block, free_port())
    logdirs = where / "runs"   # where a learner without --logdir writes its log folder
    runs_before = set(logdirs.glob("*"))
    for command in lines:
        detach = command.endswith("&")
        command = command.rstrip("&").strip()
        if quick:
            if "--resume" in command:
                continue   # its --help reads the checkpoint, which only the full run makes
            command, detach = command + " --help", False
        argv = [sys.executable if arg == "python" else arg for arg in shlex.split(command)]
        print(f"$ {command}", flush=True)
        proc = subprocess.Popen(argv, cwd=where, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        if detach:
            background.append((command, proc))
            time.sleep(0.5)
            continue
        failures += finish(command, proc, timeout)
    for command, proc in background:
        failures += finish(command, proc, timeout)
    learner = next((line for line in lines if serves_clients(line)), None)
    if learner is not None and not quick:
        logdir = re.search(r"--logdir (\S+)", learner)
        new_runs = {where / logdir.group(1)} if logdir else set(logdirs.glob("*")) - runs_before
        failures += clients_took_part(lines, new_runs)
    return failures


def clients_took_part(lines: list[str], new_runs: set[Path]) -> list[str]:
    """A learner's block: each of its other commands (a client) sent env steps over a TCP
    connection of its own, as the learner's summary.json counts them."""
    learner = next(line for line in lines if serves_clients(line))
    clients = [line for line in lines if line != learner]
    summaries = [run / "summary.json" for run in new_runs if (run / "summary.json").is_file()]
    if len(summaries) != 1:
        return [f"{learner}: expected one new log folder with a summary.json, found {sorted(map(str, new_runs))}"]
    by_client = json.loads(summaries[0].read_text())["env_steps_by_client"]
    took_part = sorted(conn for conn, steps in by_client.items() if conn.startswith("tcp:") and steps > 0)
    if len(took_part) < len(clients):
        return [f"{len(clients)} clients started ({'; '.join(clients)}), but env steps came from "
                f"{len(took_part)} TCP connections only: {by_client}"]
    return []


def finish(command: str, proc: subprocess.Popen, timeout: float) -> list[str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        return [f"{command}: still running after {timeout:g} s\n{out[-3000:]}"]
    if proc.returncode not in allowed(command):
        return [f"{command}: exit status {proc.returncode}\n{out[-3000:]}"]
    return []


def copy_of_the_repository(where: Path) -> None:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.splitlines()
    for name in listed:
        source = ROOT / name
        if source.is_file():
            (where / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, where / name)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="each command's --help only, the Python block compiled")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds each command may take (default: %(default)s)")
    a = p.parse_args(argv)
    readme = (ROOT / "README.md").read_text()
    with tempfile.TemporaryDirectory(prefix="shmrl-readme-") as tmp:
        where = Path(tmp)
        copy_of_the_repository(where)
        env = {**os.environ, "PYTHONPATH": str(where)}
        failures = []
        for block in blocks(readme, "bash"):
            failures += run_block(block, where, env, a.quick, a.timeout)
        for n, block in enumerate(blocks(readme, "python")):
            script = where / f"readme_example_{n}.py"
            script.write_text(block.replace("shmrl.train(", "shmrl.train(max_env_steps=4000, "))
            command = f"python -m py_compile {script.name}" if a.quick else f"python {script.name}"
            print(f"$ {command}  # the README's Python block {n + 1}", flush=True)
            proc = subprocess.Popen(shlex.split(command.replace("python", sys.executable, 1)), cwd=where, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
            failures += finish(command, proc, a.timeout)
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    print(f"{'all' if not failures else len(failures)} README commands {'ran' if not failures else 'failed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
