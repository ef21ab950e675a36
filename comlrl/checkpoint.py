"""The checkpoint format: layout, ownership, atomic commit, metadata, the W&B journal.

`comlrl/checkpoint_dir.py` checks and cleans a checkpoint folder as a whole (what may be
written into it, leftovers, free space, failed writes); `comlrl/fingerprints.py` fingerprints
what a resume must not change.

    checkpoint_dir/
      checkpoint-N/              N = completed epochs; only whole checkpoints carry this name
        .comlrl-split-owner.json the ownership marker: format and the run's run_uid
        agent_0/ agent_1/ ...    from_pretrained folders + optimizer.pt + rng_state.pt
        metadata.json            written last: counters, W&B identity, fingerprints, checksums
      .staging-checkpoint-N/     a checkpoint being written; its marker is its first file.
                                 Renamed to checkpoint-N only once fsynced
      .trash-checkpoint-N/       an older copy of checkpoint-N while a re-done epoch replaces it
      wandb-journal.json         the last step sent to W&B, rewritten after every log

Ownership. Nothing is deleted, pruned or overwritten unless it carries the marker of this
run (or, for leftovers cleaned at a fresh start, of some comlrl-split run: a fresh run has no
identity of its own in the folder yet, and `check_checkpoint_dir` has already refused a
folder holding anything that is not comlrl-split's). Folders are deleted metadata.json
first and marker last, so a crash half-way leaves a folder that is still marked as ours and
is no longer mistaken for a whole checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from comlrl.digests import DIGEST, file_digest

FORMAT = "comlrl-split-checkpoint"
FORMAT_VERSION = 2
"""2: file digests are "xxh3_128:<hex>" (1: bare sha256 hex, still read and verified)."""
METADATA = "metadata.json"
MARKER = ".comlrl-split-owner.json"
JOURNAL = "wandb-journal.json"
STAGING_PREFIX = ".staging-"
TRASH_PREFIX = ".trash-"
_NAME = re.compile(r"^checkpoint-(\d+)$")
_LEFTOVER = re.compile(r"^\.(staging|trash)-checkpoint-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: not ours, damaged, or from a different run."""


class CheckpointWriteError(RuntimeError):
    """Writing a checkpoint failed (disk full, I/O error); the partial folder was removed."""


# ------------------------------------------------------------------ ownership


def write_owner_marker(folder: str | os.PathLike, run_uid: str) -> None:
    """Mark `folder` as written by comlrl-split run `run_uid` (fsynced)."""
    if not run_uid:
        raise ValueError("write_owner_marker needs the run's run_uid")
    f = Path(folder) / MARKER
    tmp = f.with_name(MARKER + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "run_uid": str(run_uid)}))
    _fsync_file(tmp)
    os.replace(tmp, f)


def read_owner(folder: str | os.PathLike) -> str | None:
    """The run_uid in `folder`'s ownership marker; None if it is not marked as ours.

    A checkpoint written before markers existed counts as marked by its metadata.json
    (format comlrl-split, with a run_uid)."""
    d = Path(folder)
    for name in (MARKER, METADATA):
        try:
            data = json.loads((d / name).read_text())
        except OSError:
            continue
        except ValueError:
            data = None
        if isinstance(data, dict) and data.get("format") == FORMAT and data.get("run_uid"):
            return str(data["run_uid"])
        if name == MARKER:
            return None  # a marker that is not ours (or damaged) is not overruled by metadata
    return None


def is_owned(folder: str | os.PathLike, run_uid: str | None) -> bool:
    """True when `folder` carries our marker: of run `run_uid`, or of any run if None."""
    owner = read_owner(folder)
    return owner is not None and (run_uid is None or owner == run_uid)


def remove_owned(folder: str | os.PathLike, run_uid: str | None) -> bool:
    """Delete `folder` only if it carries our marker (see `is_owned`); True if removed.

    metadata.json goes first (the folder stops being a whole checkpoint), the marker last
    (a crash half-way leaves a folder that the next clean-up still recognises as ours).
    """
    d = Path(folder)
    if not d.is_dir() or d.is_symlink() or not is_owned(d, run_uid):
        return False
    if not (d / MARKER).exists():  # marked only by its metadata: mark it before deleting that
        write_owner_marker(d, read_owner(d))
    meta = d / METADATA
    if meta.exists():
        meta.unlink()
        _fsync_dir(d)
    for child in list(d.iterdir()):
        if child.name == MARKER:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    (d / MARKER).unlink(missing_ok=True)
    d.rmdir()
    return True


def _is_whole(folder: Path) -> bool:
    """A cheap test: metadata.json readable and every file it lists present.

    Folders are deleted metadata first, so this is False once a deletion has begun."""
    try:
        meta = read_checkpoint_metadata(folder)
    except (CheckpointError, OSError):
        return False
    return all((folder / rel).is_file() for rel in meta.get("files", {}))


def _is_journal(path: Path) -> bool:
    """The W&B journal `write_journal` writes (or its temporary file)."""
    if not path.is_file() or path.is_symlink():
        return False
    if path.name == JOURNAL + ".tmp":
        return path.stat().st_size <= 4096
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(data, dict) and "run_id" in data and "last_step" in data
            and set(data) <= {"run_id", "last_step", "format"})


# ------------------------------------------------------------------ reading


def read_checkpoint_metadata(path: str | os.PathLike) -> dict:
    """The metadata of a checkpoint folder: `wandb` (id, project, entity, name), `env_step`,
    `epoch`, `format_version`, `last_logged_step`, `run_uid`, fingerprints and checksums.

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
    except OSError as exc:
        raise CheckpointError(f"cannot read {meta_file} ({exc}).")
    except ValueError as exc:
        raise CheckpointError(f"{meta_file} is not valid JSON ({exc}); the checkpoint is damaged.")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(
            f"{folder} is not a comlrl-split checkpoint ({METADATA} has format "
            f"{got!r}, expected {FORMAT!r})."
        )
    if int(meta.get("format_version", -1)) > FORMAT_VERSION:
        raise CheckpointError(
            f"{folder} has format_version {meta['format_version']}, newer than this code's "
            f"{FORMAT_VERSION}; upgrade comlrl-split to read it."
        )
    meta["version"] = meta.get("format_version")
    return meta


def verify_checksums(path: str | os.PathLike, meta: dict | None = None,
                     direct: bool = False) -> None:
    """Raise CheckpointError naming the first file (by name) whose bytes differ from the
    recorded hash. Files are read in parallel: a checkpoint just written with O_DIRECT is not
    in the page cache, and one reader waits on the disk; several readers finish well before
    one (BENCHMARKS.md). `direct` reads past the page cache (`file_digest`), for files the
    learners will not read next."""
    folder = Path(path)
    meta = meta or read_checkpoint_metadata(folder)
    files = sorted(meta.get("files", {}).items())
    for rel, digest in files:
        if not (folder / rel).is_file():
            raise CheckpointError(f"checkpoint {folder} is missing {rel}; it is damaged.")
    schemes = [digest_scheme(digest, f"checkpoint {folder}: {rel}") for rel, digest in files]
    with ThreadPoolExecutor(max(1, min(4, len(files)))) as pool:
        actual = list(pool.map(file_digest, [folder / rel for rel, _ in files], schemes,
                               [direct] * len(files)))
    for (rel, digest), got in zip(files, actual):
        if got != digest:
            raise CheckpointError(
                f"checkpoint {folder}: {rel} changed since it was written (hash {got[:21]} "
                f"!= recorded {digest[:21]}). Restore the file or resume from another checkpoint."
            )


def list_checkpoints(checkpoint_dir: str | os.PathLike, run_uid: str | None = None) -> list[Path]:
    """Our whole checkpoints in `checkpoint_dir`, oldest first: `checkpoint-N` folders with
    comlrl-split metadata (of run `run_uid` only, when given). A foreign `checkpoint-N`
    (another tool's, no or other metadata) is not listed; `check_checkpoint_dir` refuses it."""
    d = Path(checkpoint_dir)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _NAME.match(p.name)
        if not m or not p.is_dir():
            continue
        try:
            meta = read_checkpoint_metadata(p)
        except (CheckpointError, OSError):
            continue
        if run_uid is None or meta.get("run_uid") == run_uid:
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def checkpoint_size(folder: str | os.PathLike) -> int:
    """Bytes of the files under `folder` (0 if it is gone)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _checkpoint_names(d: Path) -> list[Path]:
    try:
        return sorted(d.iterdir())
    except FileNotFoundError:
        return []


def recover_interrupted_commits(checkpoint_dir: str | os.PathLike) -> list[str]:
    """Restore `.trash-checkpoint-N` as checkpoint-N where a crash between the two renames of
    a commit left the trash copy as the only whole copy; returns the restored names.

    Only folders with our marker (of any comlrl-split run) whose metadata names the same run
    are restored; restoring moves nothing but that one folder back to its own name."""
    d = Path(checkpoint_dir)
    restored = []
    for p in _checkpoint_names(d):
        m = _LEFTOVER.match(p.name)
        if not m or m.group(1) != "trash" or not p.is_dir() or p.is_symlink():
            continue
        final = d / f"checkpoint-{m.group(2)}"
        if final.exists() or final.is_symlink():
            continue
        owner = read_owner(p)
        if owner is None or not _is_whole(p):
            continue
        if read_checkpoint_metadata(p).get("run_uid") != owner:
            continue
        os.replace(p, final)
        _fsync_dir(d)
        restored.append(final.name)
    return restored


# ------------------------------------------------------------------ writing


def staging_path(checkpoint_dir: str | os.PathLike, epoch: int) -> Path:
    return Path(checkpoint_dir) / f"{STAGING_PREFIX}checkpoint-{epoch}"


def begin_staging(checkpoint_dir: str | os.PathLike, epoch: int, run_uid: str) -> Path:
    """A fresh, empty staging folder for checkpoint-`epoch`, marked as run `run_uid`'s.

    An older staging folder of this run (an interrupted attempt) is removed first; one that
    is not ours is refused, never deleted."""
    staging = staging_path(checkpoint_dir, epoch)
    if staging.exists() or staging.is_symlink():
        if not (remove_owned(staging, run_uid) or _remove_unmarked_start(staging)):
            raise CheckpointError(
                f"checkpoint_dir {staging.parent} holds {staging.name}, which is not this run's "
                f"(no marker of run {run_uid}); move it away or pick another checkpoint_dir.")
    staging.mkdir(parents=True)
    try:
        write_owner_marker(staging, run_uid)
        _fsync_dir(staging.parent)
    except OSError:
        # e.g. a full disk: the folder was made just now and holds nothing but our marker's
        # temporary file; without a marker no later clean-up would dare remove it.
        (staging / (MARKER + ".tmp")).unlink(missing_ok=True)
        (staging / MARKER).unlink(missing_ok=True)
        staging.rmdir()
        raise
    return staging


def _remove_unmarked_start(staging: Path) -> bool:
    """Remove a staging folder that a `begin_staging` killed between its mkdir and its marker
    left behind (a checkpointer killed mid-call): empty but for the marker's temporary file,
    so it holds nothing of anyone's. Anything else in it is kept and refused."""
    if staging.is_symlink() or not staging.is_dir() or \
            {p.name for p in staging.iterdir()} - {MARKER + ".tmp"}:
        return False
    (staging / (MARKER + ".tmp")).unlink(missing_ok=True)
    staging.rmdir()
    return True


def commit_checkpoint(staging: Path, metadata: dict, total_limit: int | None = None,
                      before_publish: Callable[[Path], Any] | None = None,
                      digests: dict[str, str] | None = None) -> Path:
    """Checksum, fsync and atomically publish `staging` as checkpoint-N (N from its name).
    `digests` holds the digests (`file_digest`'s) of files their writer hashed on the way,
    by relative path.

    metadata.json is the last file written; the folder gets its public name only by one
    rename after everything is on disk, so no reader ever sees half a checkpoint.
    `before_publish(staging)` (a test hook) runs when the staged folder is complete, just
    before it is renamed. With `total_limit`, only this run's checkpoints are pruned.
    """
    staging = Path(staging)
    final = staging.parent / staging.name[len(STAGING_PREFIX):]
    run_uid = metadata.get("run_uid")
    owner = read_owner(staging)
    if owner is None:
        if not run_uid:
            raise CheckpointError(f"{staging} has no ownership marker and the metadata no "
                                  f"run_uid; start staging with begin_staging(...).")
        write_owner_marker(staging, run_uid)
        owner = run_uid
    elif run_uid and owner != run_uid:
        raise CheckpointError(f"{staging} belongs to run {owner}, not to run {run_uid}.")
    # Learners write their agent folders on their own node: without storage every node
    # shares, the checkpointer's node would publish a checkpoint that lacks them.
    lacking = [f"{agent}/{name}" for agent, names in metadata.get("agent_files", {}).items()
               for name in names if not (staging / agent / name).exists()]
    if lacking:
        raise CheckpointWriteError(
            f"{final.name} lacks {', '.join(lacking[:4])}, which the learners wrote: they "
            f"write on their own node, so checkpoint_dir must be on storage every node shares "
            f"(e.g. NFS) or all actors on one node.")
    files = {}
    for f in sorted(p for p in staging.rglob("*") if p.is_file()):
        rel = f.relative_to(staging).as_posix()
        if rel in (MARKER, METADATA, METADATA + ".tmp"):
            continue
        files[rel] = (digests or {}).get(rel) or file_digest(f)
        _fsync_file(f)
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, **metadata, "files": files}
    tmp = staging / (METADATA + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
    _fsync_file(tmp)
    os.replace(tmp, staging / METADATA)
    for d in [p for p in staging.rglob("*") if p.is_dir()] + [staging]:
        _fsync_dir(d)
    if before_publish is not None:
        before_publish(staging)
    parent = final.parent
    if final.exists() or final.is_symlink():
        # Re-doing an epoch after an interruption: replace the older copy of this run. A crash
        # between the two renames leaves the trash copy as the only whole one; the next
        # start restores it (recover_interrupted_commits).
        if read_owner(final) != owner:
            raise CheckpointError(f"{final} is not a checkpoint of run {owner}; it will not be "
                                  f"replaced. Move it away or pick another checkpoint_dir.")
        trash = parent / f"{TRASH_PREFIX}{final.name}"
        if (trash.exists() or trash.is_symlink()) and not remove_owned(trash, owner):
            raise CheckpointError(f"{trash} is not this run's; move it away.")
        os.replace(final, trash)
        _fsync_dir(parent)
        os.replace(staging, final)
        _fsync_dir(parent)
        remove_owned(trash, owner)
    else:
        os.replace(staging, final)
    _fsync_dir(parent)
    if total_limit:
        prune_checkpoints(parent, owner, total_limit)
    return final


def prune_checkpoints(checkpoint_dir: str | os.PathLike, run_uid: str, total_limit: int) -> list[str]:
    """Delete all but the newest `total_limit` checkpoints of run `run_uid`; returns their names.

    Only folders whose marker (or, for checkpoints written before markers, metadata) names
    `run_uid` are counted or deleted; other runs' and other tools' folders are never touched."""
    ours = [p for p in list_checkpoints(checkpoint_dir, run_uid) if read_owner(p) == run_uid]
    removed = []
    for old in ours[:-total_limit] if total_limit > 0 else []:
        if remove_owned(old, run_uid):
            removed.append(old.name)
    return removed


def write_journal(checkpoint_dir: str | os.PathLike, run_id: str, last_step: int) -> None:
    """Record the last step sent to W&B (atomic replace), so a resume after kill -9 skips it."""
    d = Path(checkpoint_dir)
    tmp = d / (JOURNAL + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "run_id": run_id, "last_step": int(last_step)}))
    os.replace(tmp, d / JOURNAL)


def read_journal(checkpoint_dir: str | os.PathLike, run_id: str | None) -> int:
    """Last step logged to W&B run `run_id` according to the journal (-1 if unknown)."""
    f = Path(checkpoint_dir) / JOURNAL
    try:
        data = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError):
        return -1
    return int(data.get("last_step", -1)) if data.get("run_id") == run_id else -1


def digest_scheme(recorded: str, what: str) -> str:
    """The hash a recorded digest (of file `what`) was made with: "xxh3_128:<hex>", or a
    bare sha256 hex (format_version 1)."""
    scheme = recorded.partition(":")[0] if ":" in recorded else "sha256"
    if scheme not in (DIGEST, "sha256"):
        raise CheckpointError(f"{what}: its recorded hash {recorded[:30]!r} is of a kind this "
                              f"code does not know ({DIGEST} or sha256); upgrade comlrl-split.")
    return scheme


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
