"""`MAGRPOTrainer.save_checkpoint(output_dir)`: comlrl 1.4.3's manual save, in this project's
checkpoint format, so that `train(resume_from_checkpoint=output_dir)` continues from it.

What comlrl allows, this allows: a save before any `train()` (the initial state: epoch 0) or
after a `train()` that completed (its final state); a save while `train()` runs, or after one
that raised, is refused with comlrl's RuntimeError words. A folder that exists and is not a
checkpoint is refused (FileExistsError); a checkpoint there is replaced atomically.

Where the final state comes from: the last checkpoint that `train(checkpoint_dir=...)` wrote
(always written after the last epoch), copied; without a checkpoint_dir, the learners the
finished `train()` parked (a local Ray), which still hold the weights, AdamW state and RNG,
write it as they write any checkpoint. Without either (the learners were stopped: a joined
cluster), the AdamW state is gone and the save is refused, naming `checkpoint_dir=`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import weakref
from pathlib import Path
from typing import Any

from comlrl.checkpoint import (
    _fsync_dir,
    _fsync_file,
    CheckpointError,
    file_digest,
    FORMAT,
    FORMAT_VERSION,
    MARKER,
    METADATA,
    read_checkpoint_metadata,
    verify_checksums,
    write_owner_marker,
)

_PARKED: dict = {}
"""The trainer whose completed train() parked its actors last, and the learner handles it
used: the parked learners hold that trainer's final state only while no later train() ran."""

BLOCKED_DURING = "Checkpoint saving is only supported at a completed training boundary."
BLOCKED_AFTER_FAILURE = ("Training did not reach a completed checkpoint boundary; resume the "
                         "last saved checkpoint.")


def record_final_state(trainer: Any, session: Any) -> None:
    """After the loop of a `train()` finished (the session still open): what a later
    `save_checkpoint` needs to write that final state."""
    last = Path(session.written[-1]) if session.written else None
    wandb = session.wandb
    trainer._final_state = {
        "checkpoint": str(last) if last is not None and last.name ==
        f"checkpoint-{session.progress.epoch}" and last.is_dir() else None,
        "metadata": {
            **session.progress.to_metadata(trainer.env_step),
            "last_logged_step": wandb.last_step if wandb is not None else -1,
            "wandb_rows": list(wandb.rows) if wandb is not None else [],
            "policy_versions": list(session.engine_versions),
            "wandb": (wandb.identity if wandb is not None else None) or {},
            "run_uid": session.run_uid, "fingerprints": session.fingerprints,
        },
        "learners": list(session.learners),
    }


def note_parked(trainer: Any) -> None:
    """Called once a `train()` of `trainer` ended cleanly (its actors parked, if they were)."""
    _PARKED["trainer"] = weakref.ref(trainer)


def save_checkpoint(trainer: Any, output_dir: str | os.PathLike) -> str:
    if trainer._session is not None:
        raise RuntimeError(getattr(trainer, "_save_refusal", BLOCKED_DURING))
    state = trainer._final_state
    if state == "failed":
        raise RuntimeError(BLOCKED_AFTER_FAILURE)
    target = Path(output_dir).expanduser().absolute()
    if target.is_symlink() or (target.exists() and not _is_checkpoint(target)):
        raise FileExistsError(f"Refusing to replace a non-checkpoint directory: {target}")
    if state is not None and state["checkpoint"] is not None \
            and Path(state["checkpoint"]).absolute() == target:
        return str(target)                 # train() wrote exactly this checkpoint already
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".staging-{target.name}-{time.time_ns():x}"
    try:
        if state is None:
            _write_initial(trainer, staging)
        elif state["checkpoint"] is not None:
            _copy_checkpoint(Path(state["checkpoint"]), staging)
        else:
            _write_from_parked_learners(trainer, state, staging)
        _publish(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return str(target)


def _is_checkpoint(folder: Path) -> bool:
    try:
        read_checkpoint_metadata(folder)
    except (CheckpointError, OSError):
        return False
    return True


def _publish(staging: Path, target: Path) -> None:
    """Rename the complete `staging` folder to `target`; an older checkpoint there is moved
    aside first and removed only once the new one has its name."""
    old = None
    if target.exists():
        old = target.parent / f".trash-{target.name}-{time.time_ns():x}"
        os.replace(target, old)
    try:
        os.replace(staging, target)
    except BaseException:
        if old is not None:
            os.replace(old, target)
        raise
    _fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old)


def _copy_checkpoint(source: Path, staging: Path) -> None:
    """The checkpoint train() wrote, file for file (hard links where the disk allows: its
    files are never written in place), with its metadata and marker as they are."""
    verify_checksums(source)

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, staging, copy_function=link_or_copy)


def _commit(staging: Path, metadata: dict, digests: dict[str, str]) -> None:
    """metadata.json and the marker, written as the training checkpoints' are
    (`comlrl.checkpoint.commit_checkpoint` does it for a staging folder named for its target;
    this one is named uniquely, so its target is given by the rename in `_publish`)."""
    write_owner_marker(staging, metadata["run_uid"])
    files = {}
    for f in sorted(p for p in staging.rglob("*") if p.is_file()):
        rel = f.relative_to(staging).as_posix()
        if rel in (MARKER, METADATA):
            continue
        files[rel] = digests.get(rel) or file_digest(f)
        _fsync_file(f)
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, **metadata,
            "created": time.time(), "files": files}
    (staging / METADATA).write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
    _fsync_file(staging / METADATA)
    for d in [p for p in staging.rglob("*") if p.is_dir()] + [staging]:
        _fsync_dir(d)


def _write_from_parked_learners(trainer: Any, state: dict, staging: Path) -> None:
    from workers.runtime import WARM_ACTORS, ray_get

    parked = WARM_ACTORS.get("actors")
    owner = _PARKED.get("trainer")
    learners = state["learners"]
    if parked is None or owner is None or owner() is not trainer or \
            [a._actor_id for a in parked.learners] != [a._actor_id for a in learners]:
        raise RuntimeError(
            "save_checkpoint: the learners that held this trainer's AdamW state after its "
            "train() are stopped (a joined Ray cluster, or a later train() used them), so "
            "its final state cannot be saved. Pass checkpoint_dir= to train(): its last "
            "checkpoint is the final state, and save_checkpoint copies it.")
    staging.mkdir()
    ray_get([learner.save.remote(str(staging / f"agent_{a}"))
             for a, learner in enumerate(learners)], "learners saving")
    written = ray_get([learner.saved.remote() for learner in learners], "learners saving")
    digests = {f"agent_{a}/{name}": digest for a, files in enumerate(written)
               for name, digest in (files or {}).items() if digest}
    _commit(staging, state["metadata"], digests)


def _write_initial(trainer: Any, staging: Path) -> None:
    """The state a new run starts from: the agents' weights as given, a fresh AdamW, epoch 0.
    A resume from it trains as a run that starts from scratch."""
    import torch

    from workers.runtime import OPTIMIZER_FILE, RNG_FILE, save_models

    staging.mkdir()
    folders, fingerprints = save_models(trainer, str(staging), False)
    for folder, model in zip(folders, trainer._initial_models()):
        # The learner's AdamW: over what trains (a LoRA agent's adapter alone).
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                      lr=trainer.args.agent_learning_rate, weight_decay=0.01)
        torch.save(optimizer.state_dict(), Path(folder) / OPTIMIZER_FILE)
        # A new learner's RNG is that of a new process (seeded at random by torch): nothing
        # the update computes draws from it, so any state resumes the same run.
        generator = torch.Generator()
        generator.manual_seed(int(trainer.args.seed))
        torch.save({"torch": generator.get_state(), "python": random.Random(
            trainer.args.seed).getstate(), "version": 0}, Path(folder) / RNG_FILE)
    _commit(staging, {
        "env_step": 0, "epoch": 0, "update_index": 0, "last_logged_step": -1,
        "last_train_log": -1, "wandb_rows": [], "policy_versions": [0] * trainer.num_agents,
        "wandb": trainer.last_wandb_identity or {}, "run_uid": f"{time.time_ns():x}",
        "fingerprints": fingerprints,
    }, {})
