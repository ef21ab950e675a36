"""Checkpointer: stages checkpoint folders and publishes them atomically, off the driver's path.

A plain class; `workers.ray_calls.start_actor` wraps it in `ray.remote`. Learners write their
agent folders into the staging folder it hands out; `commit` then checksums, fsyncs and renames
in the background while the driver goes on training. Every folder it creates carries the marker
of its run (`run_uid`), and it deletes or prunes only folders with that marker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from comlrl.checkpoint import begin_staging, commit_checkpoint, staging_path
from comlrl.checkpoint_dir import abort_checkpoint, check_free_space, clean_leftovers


class Checkpointer:
    """`before_publish(staging_path)`, a test hook, runs once a staged checkpoint is complete
    (metadata.json written and fsynced) and just before it is renamed to checkpoint-N, e.g.
    to hold it there while a test kills the run. Production code passes None."""

    def __init__(self, checkpoint_dir: str, total_limit: int | None = None,
                 run_uid: str | None = None,
                 before_publish: Callable[[Path], Any] | None = None):
        if not run_uid:
            raise ValueError("Checkpointer needs the run's run_uid: it marks every folder it "
                             "writes with it and deletes nothing without that mark.")
        self.checkpoint_dir = Path(checkpoint_dir)
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.total_limit = total_limit
        self.run_uid = run_uid
        self.before_publish = before_publish

    def reset(self, *args: Any) -> None:
        """Serve another train() of this process (same arguments as the constructor)."""
        Checkpointer.__init__(self, *args)

    def clean(self, fresh_start: bool = False) -> list[str]:
        """Restore a checkpoint a crash left only in `.trash-`, then remove leftovers: this
        run's, or (`fresh_start`, after check_checkpoint_dir accepted the folder) those of
        any comlrl-split run. Returns the removed names."""
        return clean_leftovers(self.checkpoint_dir, None if fresh_start else self.run_uid)

    def begin(self, epoch: int) -> str:
        """A fresh, empty staging folder for checkpoint-`epoch`, marked as this run's. A
        failure to create it (e.g. a full disk) raises CheckpointWriteError like `abort`."""
        try:
            return str(begin_staging(self.checkpoint_dir, epoch, self.run_uid))
        except OSError as exc:
            self.abort(epoch, f"{type(exc).__name__}: {exc}")

    def commit(self, epoch: int, metadata: dict, *agent_files: dict[str, str | None]) -> str:
        """Publish the staged folder as checkpoint-`epoch` with `metadata` (prunes this run's
        older checkpoints past total_limit). A write failure (e.g. a full disk) removes the
        staging folder and raises CheckpointWriteError, naming checkpoint_dir and the bytes
        needed; earlier checkpoints stay intact."""
        staging = staging_path(self.checkpoint_dir, epoch)
        metadata = {**metadata, "run_uid": metadata.get("run_uid") or self.run_uid}
        # What each learner's `saved` says it wrote (checked before publishing), with the
        # digests of the files it hashed while writing them (the others are hashed here).
        files = {f"agent_{a}": written for a, written in enumerate(agent_files)}
        if files:
            metadata["agent_files"] = {agent: sorted(written) for agent, written in files.items()}
        digests = {f"{agent}/{name}": digest for agent, written in files.items()
                   for name, digest in dict(written).items() if digest}
        try:
            final = commit_checkpoint(staging, metadata, self.total_limit, self.before_publish,
                                      digests)
        except (OSError, RuntimeError) as exc:
            self.abort(epoch, f"{type(exc).__name__}: {exc}")
        return str(final)

    def abort(self, epoch: int, error_text: str) -> None:
        """After a failed write of checkpoint-`epoch` (a learner's `save` or `commit`): remove
        this run's staging folder and raise CheckpointWriteError explaining the failure."""
        raise abort_checkpoint(self.checkpoint_dir, epoch, error_text, self.run_uid)

    def free_space_warning(self) -> str | None:
        """A warning text when the disk has less free space than the newest checkpoint."""
        return check_free_space(self.checkpoint_dir)
