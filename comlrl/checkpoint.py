"""The checkpoint format: layout, atomic commit, metadata, fingerprints and checks on resume.

    checkpoint_dir/
      checkpoint-N/              N = completed epochs; only whole checkpoints carry this name
        agent_0/ agent_1/ ...    from_pretrained folders + optimizer.pt + rng_state.pt
        driver_state.pt          the driver's RNG states
        metadata.json            written last: counters, W&B identity, fingerprints, checksums
      .staging-checkpoint-N/     a checkpoint being written (removed by the next run if a crash
                                 left it); renamed to checkpoint-N only once fsynced
      wandb-journal.json         the last step sent to W&B, rewritten after every log
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Sequence

FORMAT = "comlrl-split-checkpoint"
FORMAT_VERSION = 1
METADATA = "metadata.json"
JOURNAL = "wandb-journal.json"
STAGING_PREFIX = ".staging-"
TRASH_PREFIX = ".trash-"
_NAME = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: not ours, damaged, or from a different run."""


# ------------------------------------------------------------------ reading


def read_checkpoint_metadata(path: str | os.PathLike) -> dict:
    """The metadata of a checkpoint folder: `wandb` (id, project, entity, name), `env_step`,
    `epoch`, `format_version`, `last_logged_step`, fingerprints and file checksums.

    `metadata["wandb"]` merges into `wandb_config` to continue the same W&B run.
    """
    folder = Path(path)
    meta_file = folder / METADATA
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {folder} does not exist or is not a folder.")
    if not meta_file.is_file():
        raise CheckpointError(
            f"{folder} is not a comlrl-split checkpoint: it has no {METADATA}. Pass a "
            f"checkpoint-N folder written by MAGRPOTrainer.train(checkpoint_dir=...)."
        )
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{meta_file} is not valid JSON ({exc}); the checkpoint is damaged.")
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{folder} is not a comlrl-split checkpoint ({METADATA} has format "
            f"{meta.get('format')!r}, expected {FORMAT!r})."
        )
    if int(meta.get("format_version", -1)) > FORMAT_VERSION:
        raise CheckpointError(
            f"{folder} has format_version {meta['format_version']}, newer than this code's "
            f"{FORMAT_VERSION}; upgrade comlrl-split to read it."
        )
    meta["version"] = meta.get("format_version")
    return meta


def verify_checksums(path: str | os.PathLike, meta: dict | None = None) -> None:
    """Raise CheckpointError naming the first file whose bytes differ from the recorded hash."""
    folder = Path(path)
    meta = meta or read_checkpoint_metadata(folder)
    for rel, digest in sorted(meta.get("files", {}).items()):
        f = folder / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint {folder} is missing {rel}; it is damaged.")
        actual = file_sha256(f)
        if actual != digest:
            raise CheckpointError(
                f"checkpoint {folder}: {rel} changed since it was written (sha256 {actual[:12]} "
                f"!= recorded {digest[:12]}). Restore the file or resume from another checkpoint."
            )


def list_checkpoints(checkpoint_dir: str | os.PathLike) -> list[Path]:
    """Whole checkpoints in `checkpoint_dir`, oldest first."""
    d = Path(checkpoint_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def clean_leftovers(checkpoint_dir: str | os.PathLike) -> list[str]:
    """Remove staging/trash folders a crash left behind; returns their names."""
    d = Path(checkpoint_dir)
    removed = []
    if d.is_dir():
        for p in d.iterdir():
            if p.name.startswith((STAGING_PREFIX, TRASH_PREFIX)):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
    return removed


# ------------------------------------------------------------------ writing


def staging_path(checkpoint_dir: str | os.PathLike, epoch: int) -> Path:
    return Path(checkpoint_dir) / f"{STAGING_PREFIX}checkpoint-{epoch}"


def commit_checkpoint(staging: Path, metadata: dict, total_limit: int | None = None) -> Path:
    """Checksum, fsync and atomically publish `staging` as checkpoint-N (N from its name).

    metadata.json is the last file written; the folder gets its public name only by one
    rename after everything is on disk, so no reader ever sees half a checkpoint.
    """
    final = staging.parent / staging.name[len(STAGING_PREFIX):]
    files = {}
    for f in sorted(p for p in staging.rglob("*") if p.is_file()):
        files[f.relative_to(staging).as_posix()] = file_sha256(f)
        _fsync_file(f)
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, **metadata, "files": files}
    tmp = staging / (METADATA + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
    _fsync_file(tmp)
    os.replace(tmp, staging / METADATA)
    for d in [p for p in staging.rglob("*") if p.is_dir()] + [staging]:
        _fsync_dir(d)
    if final.exists():  # re-doing an epoch after an interruption: replace the older copy
        trash = final.parent / f"{TRASH_PREFIX}{final.name}"
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
        os.replace(staging, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, final)
    _fsync_dir(final.parent)
    if total_limit:
        for old in list_checkpoints(final.parent)[:-total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def write_journal(checkpoint_dir: str | os.PathLike, run_id: str, last_step: int) -> None:
    """Record the last step sent to W&B (atomic replace), so a resume after kill -9 skips it."""
    d = Path(checkpoint_dir)
    tmp = d / (JOURNAL + ".tmp")
    tmp.write_text(json.dumps({"run_id": run_id, "last_step": int(last_step)}))
    os.replace(tmp, d / JOURNAL)


def read_journal(checkpoint_dir: str | os.PathLike, run_id: str | None) -> int:
    """Last step logged to W&B run `run_id` according to the journal (-1 if unknown)."""
    f = Path(checkpoint_dir) / JOURNAL
    try:
        data = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError):
        return -1
    return int(data.get("last_step", -1)) if data.get("run_id") == run_id else -1


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ fingerprints


def fingerprint_callable(func: Callable | None) -> str | None:
    """Name plus source of a user callable: a different reward function gets another value."""
    if func is None:
        return None
    target = getattr(func, "func", func)  # functools.partial
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"
    try:
        src = inspect.getsource(target)
    except (OSError, TypeError):
        src = ""
    return f"{name}:{hashlib.sha256(src.encode()).hexdigest()[:16]}"


def fingerprint_rows(rows: Sequence[dict] | None) -> str | None:
    if rows is None:
        return None
    h = hashlib.sha256()
    for row in rows:
        h.update(json.dumps(row, sort_keys=True, default=str).encode())
    return f"{len(rows)} rows:{h.hexdigest()[:16]}"


def fingerprint_model_folder(folder: str | os.PathLike) -> str:
    """Hash of a saved model's config and weight files (what from_pretrained would load)."""
    h = hashlib.sha256()
    d = Path(folder)
    for f in sorted(d.iterdir()):
        if f.suffix == ".safetensors" or f.name == "config.json":
            h.update(f.name.encode())
            h.update(file_sha256(f).encode())
    return h.hexdigest()[:16]


def fingerprint_tokenizer(tokenizer: Any) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    extra = [tokenizer.eos_token, tokenizer.pad_token, getattr(tokenizer, "chat_template", None)]
    return hashlib.sha256(json.dumps([vocab, extra], default=str).encode()).hexdigest()[:16]


def compare_fingerprints(saved: dict, current: dict, resumable: frozenset) -> None:
    """Raise CheckpointError naming every setting that differs (with both values)."""
    problems = []
    saved_cfg, current_cfg = saved.get("config", {}), current.get("config", {})
    for key in sorted(set(saved_cfg) | set(current_cfg)):
        if key in resumable:
            continue
        a, b = saved_cfg.get(key), current_cfg.get(key)
        if json.dumps(a, default=str) != json.dumps(b, default=str):
            problems.append(f"config.{key}: checkpoint has {a!r}, this run has {b!r}")
    for key in sorted(set(saved) | set(current)):
        if key == "config":
            continue
        a, b = saved.get(key), current.get(key)
        if a != b:
            problems.append(f"{key}: checkpoint has {a!r}, this run has {b!r}")
    if problems:
        raise CheckpointError(
            "cannot resume: the run differs from the checkpoint in\n  - " + "\n  - ".join(problems)
            + "\nOnly num_train_epochs, devices/placement, worker counts and logging settings may "
            "change on resume. Restore these settings, or start a new run in an empty "
            "checkpoint_dir."
        )
