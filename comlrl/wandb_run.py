"""The driver's single W&B run: init from comlrl's `wandb_config`, log at env_step, no repeats,
no losses.

Every row sent is also kept (`rows`) and travels with each checkpoint, so a row that a kill
took before W&B wrote it is sent again by the resumed run. A resumed run reads which steps the
run's files already hold and sends only the others: each env_step lands exactly once. Where the
files cannot be read, the last step sent (checkpoint, or the journal rewritten after each log)
is the floor instead.
"""

from __future__ import annotations

import json
import numbers
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from comlrl.checkpoint import read_journal, write_journal

_INIT_KEYS = ("project", "entity", "name", "dir", "tags", "id", "resume", "group", "notes",
              "job_type", "mode")


class WandbRun:
    def __init__(self, wandb_config: dict | None, run_config: dict,
                 journal_dir: str | Path | None = None, last_logged_step: int = -1,
                 logged_steps: set[int] | None = None, rows: list | None = None):
        """`logged_steps`: the steps the run already holds (None: unknown, then nothing at or
        below `last_logged_step` is sent); `rows`: [step, metrics] of every row of the run so
        far, carried by the checkpoint being resumed."""
        self.config = dict(wandb_config) if wandb_config is not None else None
        self.run_config = run_config
        self.journal_dir = Path(journal_dir) if journal_dir else None
        self.last_step = last_logged_step
        self.floor = last_logged_step if logged_steps is None else -1
        self.logged_steps = set(logged_steps or ())
        self.rows = [list(r) for r in rows or []]
        self.high = -1                      # highest step handled by this process
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
        # Rows a checkpoint covers that the run's files lack come first, in step order (a
        # new run folder starts at step 0, so they still land).
        for step, metrics in sorted(self.rows, key=lambda r: r[0]):
            if step > self.floor and step not in self.logged_steps:
                self._send(metrics, step)
                self.high = max(self.high, int(step))

    def catch_sigterm(self) -> None:
        """From now on SIGTERM (ray job stop, kill) finishes the run cleanly, then exits as
        asked. Call it from the main thread (the run may have been started in another)."""
        try:
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread
            self._previous_sigterm = None

    def _on_sigterm(self, signum, frame):
        try:
            self.finish(128 + signum)
        except Exception:  # `ray job stop` signals W&B's service too; it may be gone already
            pass
        raise SystemExit(128 + signum)

    def log(self, metrics: dict, step: int) -> bool:
        """Send `metrics` at `step` unless the run already holds that step (or, where that is
        unknown, unless it is at or below the last step sent before). Steps only increase."""
        if self.run is None or step <= self.high:
            return False
        self.high = int(step)
        self.rows.append([int(step), _plain(metrics)])
        if step <= self.floor or step in self.logged_steps:
            return False  # sent by an earlier process; redone work gives the same row
        self._send(self.rows[-1][1], step)
        return True

    def _send(self, metrics: dict, step: int) -> None:
        # commit=True writes the row now; by default W&B holds a step's row until a later
        # step arrives, so a kill would lose the newest point.
        self.run.log(metrics, step=int(step), commit=True)
        self.last_step = max(self.last_step, int(step))
        self.logged_steps.add(int(step))
        if self.journal_dir is not None:
            write_journal(self.journal_dir, self.run.id, self.last_step)

    def finish(self, exit_code: int = 0) -> None:
        """Finish the run; a nonzero `exit_code` marks it failed (or stopped) in W&B."""
        run, self.run = self.run, None
        try:
            if run is not None:
                run.finish(exit_code=exit_code)
        finally:
            if self._previous_sigterm is not None:
                try:
                    signal.signal(signal.SIGTERM, self._previous_sigterm)
                except ValueError:
                    pass
                self._previous_sigterm = None


def open_wandb_run(trainer: Any, meta: dict | None, checkpoint_dir: str | None,
                   ready: Any = None) -> WandbRun:
    """The driver's W&B run for one `train()`/`evaluate()` of `trainer`, started.

    A resume continues the checkpoint's run (comlrl 1.4.3 does the same when `wandb_config`
    names no id/resume), re-sends the rows the checkpoint covers that the run's files lack,
    and never sends a step the run already holds. `evaluate()` after `train()` logs into the
    run training used. `ready()`, called once the run's files are read and before anything
    changes, may raise to refuse the start (a resume's checks, `Session._start`)."""
    cfg = trainer.wandb_config
    identity = (meta or {}).get("wandb") or trainer.last_wandb_identity
    if isinstance(cfg, dict) and identity and "id" not in cfg and "resume" not in cfg:
        cfg = {**cfg, "id": identity["id"], "resume": "allow",
               **{k: identity[k] for k in ("project", "entity")
                  if identity.get(k) and not cfg.get(k)}}
    floor, logged, rows = -1, None, []
    if meta is not None and cfg is not None:
        run_id = cfg.get("id") or (identity or {}).get("id")
        logged = steps_on_disk(run_id, cfg) if run_id else None
        journal = read_journal(checkpoint_dir, run_id) if checkpoint_dir else -1
        floor = max(int(meta.get("last_logged_step", -1)), journal)
        rows = meta.get("wandb_rows", [])
    if ready is not None:
        ready()
    trainer.wandb_config = cfg
    run_config = {"algorithm": trainer.algorithm_name, "num_agents": trainer.num_agents,
                  **{k: v for k, v in trainer.args.to_dict().items() if k != "extra"}}
    run = WandbRun(cfg, run_config, checkpoint_dir, floor, logged, rows)
    run.start()
    trainer.last_wandb_identity = run.identity or trainer.last_wandb_identity
    return run


def _plain(metrics: dict) -> dict:
    """Metrics as JSON values, to travel in a checkpoint (numbers of any kind become float)."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or isinstance(value, (str, int)):
            out[key] = value
        elif isinstance(value, numbers.Real):
            out[key] = float(value)
        else:
            out[key] = str(value)
    return out


def steps_on_disk(run_id: str, wandb_config: dict | None) -> set[int] | None:
    """Every history step of W&B run `run_id` in its local run files, or None if none found.

    This is the ground truth for "already logged": a kill can land after `run.log` returned but
    before W&B flushed the row, and offline W&B cannot be asked. Reads every run folder of the
    id (one per resumed process) under the run's W&B dir with `wandb leet inspect --json`.
    """
    base = (wandb_config or {}).get("dir") or os.environ.get("WANDB_DIR") or os.getcwd()
    files = sorted(Path(base).glob(f"wandb/*run-*-{run_id}/*.wandb"))
    exe = Path(sys.executable).parent / "wandb"
    exe = str(exe) if exe.exists() else shutil.which("wandb")
    if not files or exe is None:
        return None
    steps: set[int] = set()
    for f in files:
        out = subprocess.run([exe, "leet", "inspect", "--json", str(f)], capture_output=True,
                             text=True, timeout=120)
        for line in out.stdout.splitlines():
            if '"history"' not in line:
                continue
            rec = json.loads(line)
            if rec.get("type") == "history":
                steps.add(int(rec["history"]["item"].get("_step", -1)))
    return steps
