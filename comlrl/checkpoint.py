"""The checkpoint format: layout, ownership, atomic commit, metadata, fingerprints, checks.

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

import enum
import errno
import functools
import hashlib
import inspect
import json
import marshal
import os
import re
import shutil
import types
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

FORMAT = "comlrl-split-checkpoint"
FORMAT_VERSION = 1
METADATA = "metadata.json"
MARKER = ".comlrl-split-owner.json"
JOURNAL = "wandb-journal.json"
STAGING_PREFIX = ".staging-"
TRASH_PREFIX = ".trash-"
_NAME = re.compile(r"^checkpoint-(\d+)$")
_LEFTOVER = re.compile(r"^\.(staging|trash)-checkpoint-(\d+)$")
# The callables fingerprinted by the trainer; skip_callable_fingerprints ignores these keys.
CALLABLE_FINGERPRINT_KEYS = frozenset(
    {"reward_func", "reward_processor", "external_transition", "formatters"})


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


def clean_leftovers(checkpoint_dir: str | os.PathLike, run_uid: str | None = None) -> list[str]:
    """Restore interrupted commits, then remove what a crash left behind; returns the names.

    Leftovers are `.staging-*` and `.trash-*` folders and `checkpoint-N` folders whose
    deletion had begun (marker but no metadata.json). Only folders with our marker are
    removed: of run `run_uid`, or of any comlrl-split run when `run_uid` is None (a fresh
    start, after `check_checkpoint_dir` accepted the folder). Anything else is left alone.
    """
    d = Path(checkpoint_dir)
    recover_interrupted_commits(d)
    removed = []
    for p in _checkpoint_names(d):
        if p.name.startswith((STAGING_PREFIX, TRASH_PREFIX)):
            pass
        elif _NAME.match(p.name) and not (p / METADATA).exists():
            pass
        else:
            continue
        if remove_owned(p, run_uid):
            removed.append(p.name)
    if removed:
        _fsync_dir(d)
    return removed


def check_checkpoint_dir(checkpoint_dir: str | os.PathLike, resume_meta: dict | None) -> None:
    """Refuse a `checkpoint_dir` this run must not write into; raise CheckpointError naming it
    and the fix. Call it before anything is written there (before the checkpointer starts).

    It first restores interrupted commits (`recover_interrupted_commits`), so a checkpoint
    whose only whole copy was a `.trash-` folder is seen (and usable) under its own name.

    Ours: `checkpoint-N` with comlrl-split metadata, `.staging-`/`.trash-` folders and
    half-deleted `checkpoint-N` folders with our marker, and the W&B journal file.

    Starting fresh (`resume_meta` None): the folder must be missing, empty, or hold only
    leftovers and the journal of comlrl-split runs; whole checkpoints (of any run) and
    anything else (a user's files, a foreign `checkpoint-N`, a `wandb/` folder: comlrl-split
    writes W&B files under W&B's own dir, never here) are refused.

    Resuming: every checkpoint and leftover must be of the resumed run (`resume_meta["run_uid"]`);
    names we would write (`checkpoint-N`, `.staging-checkpoint-N`, `.trash-checkpoint-N`)
    must be ours. Other files are tolerated only where this run already wrote checkpoints
    (we never delete them); in a folder without this run's checkpoints the fresh rules apply.
    """
    d = Path(checkpoint_dir)
    if not d.exists() and not d.is_symlink():
        return
    if not d.is_dir():
        raise CheckpointError(f"checkpoint_dir {d} exists and is not a folder; pass a folder path "
                              f"(new or empty) as checkpoint_dir.")
    try:
        recover_interrupted_commits(d)
        entries = sorted(d.iterdir())
    except OSError as exc:
        raise CheckpointError(f"checkpoint_dir {d} cannot be read or repaired ({exc}); fix its "
                              f"permissions or pick another checkpoint_dir.") from exc
    resuming = resume_meta is not None
    run_uid = resume_meta.get("run_uid") if resuming else None
    whole: list[tuple[str, Any]] = []       # (name, run_uid) of our whole checkpoints
    leftovers: list[tuple[str, str]] = []   # (name, owner run_uid)
    colliding: list[str] = []               # foreign things under names we write
    foreign: list[str] = []                 # anything else not ours
    for p in entries:
        name = p.name
        if name in (JOURNAL, JOURNAL + ".tmp") and _is_journal(p):
            continue
        our_name = bool(_NAME.match(name) or _LEFTOVER.match(name))
        is_dir = p.is_dir() and not p.is_symlink()
        if _NAME.match(name) and is_dir:
            try:
                meta = read_checkpoint_metadata(p)
            except CheckpointError as exc:
                owner = read_owner(p)
                if owner is not None and not (p / METADATA).exists():
                    leftovers.append((name, owner))   # a deletion that a crash interrupted
                else:
                    colliding.append(f"{name} ({exc})")
                continue
            whole.append((name, meta.get("run_uid")))
            continue
        if name.startswith((STAGING_PREFIX, TRASH_PREFIX)) and is_dir:
            owner = read_owner(p)
            if owner is not None:
                leftovers.append((name, owner))
                continue
        if our_name:
            colliding.append(f"{name} (no comlrl-split marker or metadata)")
        else:
            foreign.append(name + ("/" if p.is_dir() else ""))

    fix_empty = "pick a new or empty checkpoint_dir for this run"
    if colliding:
        raise CheckpointError(
            f"checkpoint_dir {d} holds folders that comlrl-split did not write under names it "
            f"uses: {', '.join(colliding[:5])}. It will not overwrite, prune or delete them; "
            f"{fix_empty}, or move them out of {d}.")
    if not resuming and whole:
        names = [n for n, _ in whole]
        uids = sorted({str(u) for _, u in whole})
        raise CheckpointError(
            f"checkpoint_dir {d} already holds checkpoints of run {', '.join(uids)} "
            f"({', '.join(names[-3:])}). Pass resume_from_checkpoint={d / names[-1]} (or "
            f"another of them) to continue that run, or {fix_empty}.")
    if resuming:
        others = [f"{n} (run {u})" for n, u in whole + leftovers if u != run_uid]
        if others:
            raise CheckpointError(
                f"checkpoint_dir {d} holds {', '.join(others[:5])} of another run, while this "
                f"run resumes run {run_uid}. Pass the checkpoint_dir of the run you resume, or "
                f"{fix_empty}.")
    holds_this_run = resuming and bool(whole or leftovers)
    if foreign and not holds_this_run:
        raise CheckpointError(
            f"checkpoint_dir {d} is not empty: it holds {', '.join(foreign[:5])}"
            f"{' and more' if len(foreign) > 5 else ''}, which comlrl-split did not write. A "
            f"run starts only in a new or empty checkpoint_dir (or one holding only its own "
            f"leftovers), so that clean-up and pruning can never touch your files; {fix_empty}, "
            f"or move those files out of {d}.")


# ------------------------------------------------------------------ writing


def staging_path(checkpoint_dir: str | os.PathLike, epoch: int) -> Path:
    return Path(checkpoint_dir) / f"{STAGING_PREFIX}checkpoint-{epoch}"


def begin_staging(checkpoint_dir: str | os.PathLike, epoch: int, run_uid: str) -> Path:
    """A fresh, empty staging folder for checkpoint-`epoch`, marked as run `run_uid`'s.

    An older staging folder of this run (an interrupted attempt) is removed first; one that
    is not ours is refused, never deleted."""
    staging = staging_path(checkpoint_dir, epoch)
    if staging.exists() or staging.is_symlink():
        if not remove_owned(staging, run_uid):
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


def commit_checkpoint(staging: Path, metadata: dict, total_limit: int | None = None,
                      before_publish: Callable[[Path], Any] | None = None) -> Path:
    """Checksum, fsync and atomically publish `staging` as checkpoint-N (N from its name).

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
    files = {}
    for f in sorted(p for p in staging.rglob("*") if p.is_file()):
        rel = f.relative_to(staging).as_posix()
        if rel in (MARKER, METADATA, METADATA + ".tmp"):
            continue
        files[rel] = file_sha256(f)
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


# ------------------------------------------------------------------ disk space

_DISK_FULL_SIGNS = ("no space left on device", "enospc", "errno 28", "[errno 122]",
                    "disk quota exceeded", "basic_ios::clear", "iostream error",
                    "file write failed", "unexpected pos")  # the last: torch's zip writer
_NEARLY_FULL = 1 << 20  # bytes free below which a failed write is taken for a full disk


def is_disk_full(error: BaseException | str) -> bool:
    """Whether an exception (or its text) says the disk (or quota) is full."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return any(sign in text.lower() for sign in _DISK_FULL_SIGNS)


def check_free_space(checkpoint_dir: str | os.PathLike) -> str | None:
    """A warning text when the disk of `checkpoint_dir` has less free space than its newest
    checkpoint takes (the next one will likely not fit); None otherwise or with none yet."""
    d = Path(checkpoint_dir)
    found = list_checkpoints(d)
    if not found:
        return None
    size = checkpoint_size(found[-1])
    free = shutil.disk_usage(d).free
    if free >= size:
        return None
    return (f"checkpoint_dir {d} has {free} bytes free, less than the {size} bytes of its newest "
            f"checkpoint {found[-1].name}: the next checkpoint will likely fail with a full disk. "
            f"Free at least {size - free} bytes, lower checkpoint_total_limit, or use a "
            f"checkpoint_dir on a larger disk.")


def abort_checkpoint(checkpoint_dir: str | os.PathLike, epoch: int, error_text: str,
                     run_uid: str | None = None) -> CheckpointWriteError:
    """Clean up after a failed checkpoint write and return the error to raise.

    Removes this run's partial staging folder (never one without our marker), restores a
    checkpoint whose only whole copy is in `.trash-` (a failure between the commit's two
    renames), and explains: for a full disk it names `checkpoint_dir`, the bytes needed
    (the size of the newest checkpoint, else at least what was staged) and the bytes free.
    """
    d = Path(checkpoint_dir)
    staging = staging_path(d, epoch)
    staged = checkpoint_size(staging) if staging.is_dir() else 0
    try:
        full_now = shutil.disk_usage(d).free < _NEARLY_FULL
    except OSError:
        full_now = False
    previous = list_checkpoints(d, run_uid)
    prev_size = checkpoint_size(previous[-1]) if previous else 0
    notes = []
    try:
        if staging.exists() or staging.is_symlink():
            if remove_owned(staging, run_uid):
                notes.append(f"the partial {staging.name} was removed")
            else:
                notes.append(f"{staging} is not this run's and was left in place")
    except OSError as exc:
        notes.append(f"removing {staging} failed too ({exc}); delete it by hand")
    try:
        for name in recover_interrupted_commits(d):
            notes.append(f"{name} was restored from its .trash- copy")
    except OSError as exc:
        notes.append(f"restoring checkpoint-{epoch} from its .trash- copy failed ({exc}); "
                     f"rename {TRASH_PREFIX}checkpoint-{epoch} to checkpoint-{epoch} by hand")
    try:
        free = shutil.disk_usage(d).free
    except OSError:
        free = -1
    done = "; ".join(notes) or "nothing was left to clean"
    needed = max(prev_size, staged)
    if is_disk_full(error_text) or full_now:
        how = (f"the size of {previous[-1].name}" if prev_size >= staged
               else "at least what was written before the disk filled")
        return CheckpointWriteError(
            f"checkpoint_dir {d} ran out of disk space writing checkpoint-{epoch}: a checkpoint "
            f"needs about {needed} bytes ({how}) and {free} bytes are free. {done}; earlier "
            f"checkpoints are intact. Free at least {max(needed - max(free, 0), 0)} more bytes, "
            f"lower checkpoint_total_limit, or use a checkpoint_dir on a larger disk, then "
            f"resume from the newest checkpoint. (The write failed with: {error_text})")
    return CheckpointWriteError(
        f"writing checkpoint-{epoch} into checkpoint_dir {d} failed: {error_text}. {done}; "
        f"earlier checkpoints are intact.")


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

SKIP_CALLABLE_FINGERPRINTS = "MAGRPOConfig(skip_callable_fingerprints=True)"
_SIMPLE = (type(None), bool, int, float, complex, str)
_MAX_DEPTH = 16
# Tensors/arrays above this size are hashed on _SAMPLE evenly spaced elements (plus dtype and
# shape), so a closure over a large model neither copies it to the host nor hashes gigabytes.
_LARGE_BYTES = 64 << 20
_SAMPLE = 1 << 20


def _sha16(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:16]


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', None) or '?'}.{getattr(obj, '__qualname__', None) or type(obj).__qualname__}"


def _code_hash(code: types.CodeType) -> str:
    return _sha16(marshal.dumps(code))


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _is_simple_constant(value: Any) -> bool:
    if isinstance(value, _SIMPLE) or isinstance(value, bytes):
        return True
    if isinstance(value, (tuple, frozenset)):
        return all(_is_simple_constant(v) for v in value)
    return False


class _Describer:
    """Turns a callable and the state it uses into address-free tokens; what cannot be
    described is named in `problems` and replaced by its type's name (stable, but blind)."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self._active: set[int] = set()

    def fail(self, where: str, obj: Any, why: str = "") -> list:
        kind = type(obj).__qualname__
        self.problems.append(f"{where} ({kind}{': ' + why if why else ''})")
        return ["unhashable", _qualname(type(obj))]

    def value(self, obj: Any, where: str, depth: int = 0) -> Any:
        if isinstance(obj, _SIMPLE):
            return [type(obj).__name__, repr(obj)]
        if isinstance(obj, (bytes, bytearray)):
            return [type(obj).__name__, _sha16(bytes(obj))]
        if isinstance(obj, enum.Enum):
            return ["enum", _qualname(type(obj)), obj.name]
        if depth > _MAX_DEPTH:
            return self.fail(where, obj, "nested too deeply")
        if id(obj) in self._active:
            return ["cycle", _qualname(type(obj))]
        self._active.add(id(obj))
        try:
            return self._compound(obj, where, depth + 1)
        except Exception as exc:  # a state_dict() or property that raises, a tensor we can't read
            return self.fail(where, obj, f"{type(exc).__name__}: {exc}")
        finally:
            self._active.discard(id(obj))

    def _compound(self, obj: Any, where: str, depth: int) -> Any:
        if isinstance(obj, (tuple, list)):
            return [type(obj).__name__, [self.value(v, f"{where}[{i}]", depth)
                                         for i, v in enumerate(obj)]]
        if isinstance(obj, (set, frozenset)):
            items = [self.value(v, f"{where}{{}}", depth) for v in obj]
            return [type(obj).__name__, sorted(items, key=lambda t: json.dumps(t))]
        if isinstance(obj, dict):
            items = [[self.value(k, f"{where} key", depth), self.value(v, f"{where}[{k!r}]", depth)]
                     for k, v in obj.items()]
            return ["dict", sorted(items, key=lambda kv: json.dumps(kv[0]))]
        mod = type(obj).__module__ or ""
        if mod.startswith("numpy") and hasattr(obj, "dtype") and hasattr(obj, "tobytes"):
            import numpy as np

            arr = np.asarray(obj)
            if arr.dtype.hasobject:
                return ["ndarray-object", list(arr.shape), self.value(arr.tolist(), where, depth)]
            flat = arr.reshape(-1)
            if arr.nbytes > _LARGE_BYTES:
                flat = flat[np.arange(_SAMPLE, dtype=np.int64) * (flat.size - 1) // (_SAMPLE - 1)]
            return ["ndarray", str(arr.dtype), list(arr.shape),
                    _sha16(np.ascontiguousarray(flat).tobytes())]
        if mod.startswith("torch") and hasattr(obj, "dtype") and hasattr(obj, "detach"):
            import torch

            flat = obj.detach().reshape(-1)
            if flat.numel() * flat.element_size() > _LARGE_BYTES:
                idx = torch.arange(_SAMPLE, dtype=torch.int64, device=flat.device)
                flat = flat[idx * (flat.numel() - 1) // (_SAMPLE - 1)]
            raw = flat.to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
            return ["tensor", str(obj.dtype), list(obj.shape), _sha16(raw)]
        if callable(getattr(obj, "get_vocab", None)) and hasattr(obj, "eos_token"):
            return ["tokenizer", _qualname(type(obj)), fingerprint_tokenizer(obj)]
        if isinstance(obj, functools.partial):
            return ["partial", self.value(obj.func, f"{where}.func", depth),
                    self.value(obj.args, f"{where}.args", depth),
                    self.value(obj.keywords, f"{where}.keywords", depth)]
        if isinstance(obj, types.FunctionType):
            return ["function", self.function(obj, where, depth)]
        if isinstance(obj, types.MethodType):
            return ["method", self.value(obj.__func__, f"{where}.__func__", depth),
                    self.value(obj.__self__, f"{where}.__self__", depth)]
        if isinstance(obj, (types.BuiltinFunctionType, types.BuiltinMethodType)):
            owner = getattr(obj, "__self__", None)
            bound = None if owner is None or isinstance(owner, types.ModuleType) \
                else self.value(owner, f"{where}.__self__", depth)
            return ["builtin", _qualname(obj), bound]
        if isinstance(obj, types.ModuleType):
            return ["module", obj.__name__]
        if isinstance(obj, type):
            return ["class", self.klass(obj)]
        if isinstance(obj, types.CodeType):
            return ["code", _code_hash(obj)]
        return self.instance(obj, where, depth)

    def instance(self, obj: Any, where: str, depth: int) -> Any:
        """An object: its class (source) and state (state_dict() if it has one, else
        __dict__ and __slots__); never its repr, which may hold a memory address."""
        cls = type(obj)
        state_dict = getattr(obj, "state_dict", None)
        if callable(state_dict) and not isinstance(obj, type):
            return ["object", self.klass(cls), self.value(state_dict(), f"{where}.state_dict()",
                                                        depth)]
        state: dict[str, Any] = {}
        has_state = False
        if hasattr(obj, "__dict__"):
            state.update(vars(obj))
            has_state = True
        for klass in cls.__mro__:
            for slot in getattr(klass, "__slots__", ()) or ():
                if isinstance(slot, str) and slot not in ("__dict__", "__weakref__") \
                        and hasattr(obj, slot):
                    state[slot] = getattr(obj, slot)
                    has_state = True
        if not has_state and len(cls.__mro__) > 1 and all(
                "__slots__" in vars(k) for k in cls.__mro__[:-1]):
            has_state = True  # a Python class with empty __slots__ all the way: no state
        if not has_state:
            return self.fail(where, obj, "no __dict__, __slots__ or state_dict()")
        return ["object", self.klass(cls), self.value(state, f"{where}.__dict__", depth)]

    def klass(self, cls: type) -> list:
        """A class by name and source (its own and its bases' from the same package)."""
        top = (cls.__module__ or "").split(".")[0]
        parts = []
        for k in cls.__mro__:
            if (k.__module__ or "").split(".")[0] != top or k.__module__ == "builtins":
                continue
            try:
                parts.append(_sha16(inspect.getsource(k)))
            except (OSError, TypeError):
                codes = sorted((name, _code_hash(f.__code__)) for name, f in vars(k).items()
                               if isinstance(f, types.FunctionType))
                parts.append(_sha16(json.dumps(codes)))
        return [_qualname(cls), parts]

    def function(self, func: types.FunctionType, where: str, depth: int = 0) -> str:
        """`module.qualname:sha(source)` as before, plus (when there are any) a hash of what
        the source does not show: closure cells, defaults, simple globals it reads, and the
        compiled code when there is no source."""
        name = _qualname(func)
        try:
            src = inspect.getsource(func)
        except (OSError, TypeError):
            src = None
        base = f"{name}:{_sha16(src or '')}"
        code = func.__code__
        extras: dict[str, Any] = {}
        if src is None:
            extras["code"] = _code_hash(code)
        if func.__closure__:
            cells = {}
            for var, cell in zip(code.co_freevars, func.__closure__):
                try:
                    content = cell.cell_contents
                except ValueError:
                    cells[var] = ["empty"]
                    continue
                cells[var] = self.value(content, f"{where} closure {var!r}", depth)
            extras["closure"] = cells
        if func.__defaults__:
            extras["defaults"] = self.value(func.__defaults__, f"{where} defaults", depth)
        if func.__kwdefaults__:
            extras["kwdefaults"] = self.value(func.__kwdefaults__, f"{where} defaults", depth)
        scope = getattr(func, "__globals__", {})
        simple = {n: self.value(scope[n], f"{where} global {n}", depth)
                  for n in sorted(_global_names(code))
                  if n in scope and _is_simple_constant(scope[n])}
        if simple:
            extras["globals"] = simple
        if not extras:
            return base
        return f"{base}+{_sha16(json.dumps(extras, sort_keys=True))}"


def fingerprint_callable(func: Callable | None, label: str | None = None,
                         warn: bool = True) -> str | None:
    """A value that changes when what `func` does changes, equal across processes.

    Plain functions: `module.qualname:sha(source)` (as in earlier versions), plus a hash of
    their closure cells, defaults and the simple global constants they read when they have
    any. functools.partial: its func plus args and keywords. Bound methods: the function plus
    the instance's state. Callable objects: their class source plus their state
    (`state_dict()` if they have one, else `__dict__`/`__slots__`). Tensors and arrays are
    hashed by dtype, shape and bytes; containers element by element; never a repr that could
    hold a memory address.

    A part that cannot be described (an object without reachable state, e.g. a C-extension
    handle) is replaced by its type's name, so the value stays stable but cannot see changes
    there; with `warn`, ONE warning names the callable (`label`, e.g. "reward_func") and the
    setting that skips the callable check, MAGRPOConfig(skip_callable_fingerprints=True).
    """
    if func is None:
        return None
    d = _Describer()
    where = label or "callable"
    if isinstance(func, types.FunctionType):
        fp = d.function(func, where)
    else:
        token = d.value(func, where)
        target = func
        while isinstance(target, functools.partial):
            target = target.func
        if isinstance(target, types.MethodType):
            target = target.__func__
        shown = target if isinstance(target, (types.FunctionType, type)) or hasattr(
            target, "__qualname__") else type(target)
        prefix = "partial:" if isinstance(func, functools.partial) else ""
        fp = f"{prefix}{_qualname(shown)}:{_sha16(json.dumps(token))}"
    if d.problems and warn:
        warnings.warn(
            f"{where} {fp.split(':')[0]}: cannot fingerprint {'; '.join(d.problems[:3])}"
            f"{' and more' if len(d.problems) > 3 else ''}. A change there will not be noticed "
            f"when a checkpoint is resumed. If resuming then reports a difference in {where} "
            f"that you made on purpose, {SKIP_CALLABLE_FINGERPRINTS} skips the check of the "
            f"callables.", UserWarning, stacklevel=2)
    return fp


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


def compare_fingerprints(saved: dict, current: dict, resumable: frozenset,
                         skip_callables: bool = False) -> None:
    """Raise CheckpointError naming every setting that differs (with both values).

    `skip_callables` (MAGRPOConfig.skip_callable_fingerprints) ignores the callables' keys
    (CALLABLE_FINGERPRINT_KEYS)."""
    problems = []
    saved_cfg, current_cfg = saved.get("config", {}), current.get("config", {})
    for key in sorted(set(saved_cfg) | set(current_cfg)):
        if key in resumable:
            continue
        a, b = saved_cfg.get(key), current_cfg.get(key)
        if json.dumps(a, default=str) != json.dumps(b, default=str):
            problems.append(f"config.{key}: checkpoint has {a!r}, this run has {b!r}")
    callables_differ = False
    for key in sorted(set(saved) | set(current)):
        if key == "config" or (skip_callables and key in CALLABLE_FINGERPRINT_KEYS):
            continue
        a, b = saved.get(key), current.get(key)
        if a != b:
            problems.append(f"{key}: checkpoint has {a!r}, this run has {b!r}")
            callables_differ |= key in CALLABLE_FINGERPRINT_KEYS
    if problems:
        hint = (f"\nIf a callable changed on purpose (or its fingerprint is not stable), "
                f"{SKIP_CALLABLE_FINGERPRINTS} skips the check of the callables."
                if callables_differ else "")
        raise CheckpointError(
            "cannot resume: the run differs from the checkpoint in\n  - " + "\n  - ".join(problems)
            + "\nOnly num_train_epochs, devices/placement, worker counts and logging settings may "
            "change on resume. Restore these settings, or start a new run in an empty "
            "checkpoint_dir." + hint
        )
