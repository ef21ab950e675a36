"""The driver's single W&B run: init from comlrl's `wandb_config`, log at env_step, no repeats.

Steps at or below the last one already sent are dropped, which is what makes a resumed run
(even after kill -9) add no duplicate points: the last sent step comes from the checkpoint and
from a journal rewritten after every log (offline W&B cannot tell us).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from comlrl.checkpoint import write_journal

_INIT_KEYS = ("project", "entity", "name", "dir", "tags", "id", "resume", "group", "notes",
              "job_type", "mode")


class WandbRun:
    def __init__(self, wandb_config: dict | None, run_config: dict,
                 journal_dir: str | Path | None = None, last_logged_step: int = -1):
        self.config = dict(wandb_config) if wandb_config is not None else None
        self.run_config = run_config
        self.journal_dir = Path(journal_dir) if journal_dir else None
        self.last_step = last_logged_step
        self.run = None
        self.identity: dict | None = None
        self._previous_sigterm = None

    @property
    def enabled(self) -> bool:
        return self.config is not None

    def start(self) -> None:
        if not self.enabled or self.run is not None:
            return
        import wandb

        kwargs: dict[str, Any] = {k: self.config[k] for k in _INIT_KEYS if k in self.config}
        if "name" not in kwargs and self.config.get("run_name"):
            kwargs["name"] = self.config["run_name"]
        # wandb reads WANDB_DIR once per process; read it at every init so that each run
        # (and each test) goes where the environment says at that moment.
        if not kwargs.get("dir") and os.environ.get("WANDB_DIR"):
            kwargs["dir"] = os.environ["WANDB_DIR"]
        if kwargs.get("dir"):
            Path(kwargs["dir"]).mkdir(parents=True, exist_ok=True)
        # Flush every second so a SIGKILL loses at most about a second of metrics.
        settings = wandb.Settings(x_transaction_log_flush_interval=1.0, console="off",
                                  silent=True)
        self.run = wandb.init(config=self.run_config, settings=settings, **kwargs)
        self.identity = {"id": self.run.id, "project": self.run.project,
                         "entity": self.run.entity or self.config.get("entity") or "",
                         "name": self.run.name}
        # SIGTERM (ray job stop, kill) finishes the run cleanly, then exits as asked.
        try:
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread
            self._previous_sigterm = None

    def _on_sigterm(self, signum, frame):
        try:
            self.finish()
        except Exception:  # `ray job stop` signals W&B's service too; it may be gone already
            pass
        raise SystemExit(128 + signum)

    def log(self, metrics: dict, step: int) -> bool:
        """Send `metrics` at `step` unless a point at or after it was already sent."""
        if self.run is None or step <= self.last_step:
            return False
        # commit=True writes the row now; by default W&B holds a step's row until a later
        # step arrives, so a kill would lose the newest point. Each step is logged once.
        self.run.log(metrics, step=int(step), commit=True)
        self.last_step = int(step)
        if self.journal_dir is not None:
            write_journal(self.journal_dir, self.run.id, self.last_step)
        return True

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
        if self._previous_sigterm is not None:
            try:
                signal.signal(signal.SIGTERM, self._previous_sigterm)
            except ValueError:
                pass
            self._previous_sigterm = None


def last_step_on_disk(run_id: str, wandb_config: dict | None) -> int | None:
    """Highest history step of W&B run `run_id` in its local run files, or None if none found.

    This is the ground truth for "already logged": a kill can land after `run.log` returned but
    before W&B flushed the row, and offline W&B cannot be asked. Reads every run folder of the
    id (one per resumed process) under the run's W&B dir with `wandb leet inspect --json`.
    """
    import json
    import shutil
    import subprocess
    import sys

    base = (wandb_config or {}).get("dir") or os.environ.get("WANDB_DIR") or os.getcwd()
    files = sorted(Path(base).glob(f"wandb/*run-*-{run_id}/*.wandb"))
    exe = Path(sys.executable).parent / "wandb"
    exe = str(exe) if exe.exists() else shutil.which("wandb")
    if not files or exe is None:
        return None
    best = -1
    for f in files:
        out = subprocess.run([exe, "leet", "inspect", "--json", str(f)], capture_output=True,
                             text=True, timeout=120)
        for line in out.stdout.splitlines():
            if '"history"' not in line:
                continue
            rec = json.loads(line)
            if rec.get("type") == "history":
                best = max(best, int(rec["history"]["item"].get("_step", -1)))
    return best
