"""Learning curves of shmrl runs: the mean return against env steps and against wall time.

    python -m shmrl.plot runs/a runs/b runs/c -o curves.png
    python -m shmrl.plot runs/cartpole-* --title "CartPole-v1, 5 seeds"
    python -m shmrl.plot runs                 # every run under runs/, as tensorboard --logdir runs

Each RUN_DIR is a log folder of ``python -m shmrl.run`` (its metrics.jsonl: one line per
update), or a folder of such folders: every run under it (at any depth) is plotted. Several runs are overlaid, one colour each, labelled with their folder's name;
a dashed line marks the stop return when all runs share one. Needs matplotlib
(``pip install -e '.[plot]'``); where it is installed, every run also draws its own curve
into its log folder when it ends (``learning_curves.png``, ``plot_run``).

Exit status: 0 with the PNG written, 1 when a folder has no metrics yet (and no run under
it) or matplotlib is missing, 2 for a bad command line (one line ``error: ...``).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def run_dirs(path: Path) -> list[Path]:
    """``path`` if it is a run's log folder (it has metrics.jsonl), else every run folder
    under it, in name order; an error naming ``path`` when there is none."""
    if (path / "metrics.jsonl").exists() or not path.is_dir():
        return [path]        # a run (or what load will say is missing)
    runs = sorted({p.parent for p in path.rglob("metrics.jsonl")})
    if not runs:
        raise ValueError(f"{path} is no run's log folder (no metrics.jsonl) and holds none")
    return runs


def load(run_dir: Path, name: str | None = None) -> dict:
    rows = []
    with open(run_dir / "metrics.jsonl") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{run_dir}/metrics.jsonl line {n}: {e}") from None
    if not rows:
        raise ValueError(f"{run_dir}/metrics.jsonl has no updates yet")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return {"name": name or run_dir.name, "rows": rows, "stop_return": summary.get("config", {}).get("stop_return")}


def _import_matplotlib():
    from matplotlib.figure import Figure   # Figure alone draws to files: no pyplot, no display

    return Figure


def plot(runs: list[dict], out: Path, title: str | None = None) -> None:
    fig = _import_matplotlib()(figsize=(11, 4.2))
    by_steps, by_time = fig.subplots(1, 2, sharey=True)
    for run in runs:
        # No return yet (before the first episode): null in metrics.jsonl (NaN in older runs).
        rows = [r for r in run["rows"] if isinstance(r.get("return_mean"), (int, float)) and
                math.isfinite(r["return_mean"])]
        steps = [r["env_steps"] for r in rows]
        seconds = [r["elapsed_s"] for r in rows]
        returns = [r["return_mean"] for r in rows]
        line, = by_steps.plot(steps, returns, label=run["name"], linewidth=1.4)
        by_time.plot(seconds, returns, color=line.get_color(), linewidth=1.4)
    stops = {run["stop_return"] for run in runs}
    if len(stops) == 1 and None not in stops and math.isfinite(next(iter(stops))):
        for ax in (by_steps, by_time):
            ax.axhline(next(iter(stops)), color="grey", linestyle="--", linewidth=1, label="stop return")
    by_steps.set_xlabel("env steps")
    by_time.set_xlabel("seconds from command start")
    by_steps.set_ylabel("mean return of the last 100 episodes")
    for ax in (by_steps, by_time):
        ax.grid(alpha=0.3)
    by_steps.legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


RUN_PLOT = "learning_curves.png"   # what a run draws into its log folder when it ends


def plot_run(logdir) -> Path | None:
    """Draw a finished run's curve into its log folder (``RUN_PLOT``) where matplotlib is
    installed; returns the file, or None (no matplotlib, no update yet). Never raises: a
    plot is not worth failing a run for."""
    import importlib.util
    import logging

    if importlib.util.find_spec("matplotlib") is None:
        return None
    try:
        out = Path(logdir) / RUN_PLOT
        plot([load(Path(logdir))], out)
        return out
    except Exception as e:   # no metrics yet, a full disk, a matplotlib that fails to load
        logging.getLogger("shmrl.plot").warning("no %s written: %s", RUN_PLOT, e)
        return None


def main(argv=None) -> int:
    from shmrl.config.faces import PlotSettings
    from shmrl.config.flags import face_parser, parse_settings

    a = parse_settings(face_parser(PlotSettings, "python -m shmrl.plot", __doc__), PlotSettings, argv)
    try:
        runs = [load(d, str(d.relative_to(top)) if d != top else None) for top in a.runs for d in run_dirs(top)]
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        plot(runs, a.output, a.title)
    except ImportError:
        print("error: shmrl.plot needs matplotlib: pip install matplotlib (or pip install -e '.[plot]' in a "
              "clone)", file=sys.stderr)
        return 1
    print(f"wrote {a.output} ({len(runs)} run{'s' if len(runs) > 1 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
