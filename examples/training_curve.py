"""A run's W&B history read back from its offline files, and its training curve as a PNG.

`wandb_history` is the one reader the demo, the tests and the benchmarks share: every history
record of the offline runs in a W&B folder, decoded by `wandb leet inspect --json` (the `wandb`
command installed next to this Python). `plot_training_curve` draws reward against env_step
from such records; it needs matplotlib (the `plot` extra) and draws with the Agg backend.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REWARD_KEY = "turn_1/reward_mean"
STEP_KEY = "_step"  # the trainer logs every metric at env_step


def wandb_history(wandb_dir: str | Path, run_id: str | None = None) -> list[dict]:
    """Every history record of the offline runs under `wandb_dir` (the WANDB_DIR, or the
    `wandb` folder inside it), oldest run folder first; only run `run_id`'s when given.

    A resumed run writes one `offline-run-<time>-<id>` folder per process, so one run id can
    own several folders; each record carries its folder's name as `_run`.
    """
    base = Path(wandb_dir)
    if (base / "wandb").is_dir():
        base = base / "wandb"
    exe = Path(sys.executable).parent / "wandb"
    command = str(exe) if exe.exists() else shutil.which("wandb") or "wandb"
    records: list[dict] = []
    for folder in sorted(base.glob("offline-run-*")):
        if run_id and not folder.name.endswith(f"-{run_id}"):
            continue
        logs = sorted(folder.glob("*.wandb"))
        if not logs:
            continue
        shown = subprocess.run([command, "leet", "inspect", "--json", str(logs[0])],
                               capture_output=True, text=True, check=True)
        for line in shown.stdout.splitlines():
            if not line.startswith("{"):
                continue
            entry = json.loads(line)
            if entry.get("type") == "history":
                records.append({**entry["history"]["item"], "_run": folder.name})
    return records


def _points(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    rows = sorted((r for r in records if key in r and STEP_KEY in r), key=lambda r: r[STEP_KEY])
    return [r[STEP_KEY] for r in rows], [r[key] for r in rows]


def plot_training_curve(records: list[dict], png_path: str | Path, *,
                        resume_step: int | None = None, resume_label: str | None = None,
                        reference: list[dict] | None = None, key: str = REWARD_KEY,
                        title: str = "Training curve") -> Path:
    """Draw `key` against env_step into `png_path` and return that path.

    `records` are one run's `wandb_history` rows. Its first run folder is drawn as the first
    half and any later folder (a resumed process) in a second colour; `resume_step` marks the
    env_step the run resumed from (`resume_label` names it in the legend); `reference`, the rows of an uninterrupted run, is drawn
    underneath for comparison.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    folders = sorted({r["_run"] for r in records if "_run" in r})
    first = [r for r in records if r.get("_run") == folders[0]] if folders else records
    resumed = [r for r in records if folders and r.get("_run") != folders[0]]

    figure = Figure(figsize=(8, 4.5), dpi=110)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    if reference:
        axes.plot(*_points(reference, key), color="0.6", linestyle="--", linewidth=3,
                  label="uninterrupted run", zorder=1)
    axes.plot(*_points(first, key), color="tab:blue", marker="o", markersize=3,
              label="first half" if resumed else "training", zorder=2)
    if resumed:
        axes.plot(*_points(resumed, key), color="tab:orange", marker="o", markersize=3,
                  label="resumed half", zorder=2)
    if resume_step is not None:
        axes.axvline(resume_step, color="tab:red", linestyle=":", linewidth=1.5,
                     label=resume_label or f"resumed at env_step {resume_step}", zorder=3)
    axes.set_xlabel("env_step")
    axes.set_ylabel(key)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(loc="best", fontsize="small")
    figure.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png_path, format="png")
    return png_path
