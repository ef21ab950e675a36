"""Checkpointer: stages checkpoint folders and publishes them atomically, off the driver's path.

A plain class; `workers.launch` wraps it in `ray.remote`. Learners write their agent folders
into the staging folder it hands out; `commit` then checksums, fsyncs and renames in the
background while the driver goes on training.
"""

from __future__ import annotations

import io
import os
import shutil
import time
from pathlib import Path

from comlrl.checkpoint import clean_leftovers, commit_checkpoint, staging_path


class Checkpointer:
    def __init__(self, checkpoint_dir: str, total_limit: int | None = None):
        self.checkpoint_dir = Path(checkpoint_dir)
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.total_limit = total_limit

    def clean(self) -> list[str]:
        """Remove staging folders left by a crash."""
        return clean_leftovers(self.checkpoint_dir)

    def begin(self, epoch: int) -> str:
        """A fresh, empty staging folder for checkpoint-`epoch`."""
        staging = staging_path(self.checkpoint_dir, epoch)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        return str(staging)

    def commit(self, epoch: int, metadata: dict, driver_state: dict) -> str:
        """Write the driver state and metadata, then publish the staged folder as checkpoint-N."""
        import torch

        staging = staging_path(self.checkpoint_dir, epoch)
        buf = io.BytesIO()
        torch.save(driver_state, buf)
        (staging / "driver_state.pt").write_bytes(buf.getvalue())
        # Fault-injection knob for tests: hold the checkpoint in staging for this long, so a
        # kill can land while it is half written.
        time.sleep(float(os.environ.get("COMLRL_CHECKPOINT_PAUSE_S", "0")))
        return str(commit_checkpoint(staging, metadata, self.total_limit))
