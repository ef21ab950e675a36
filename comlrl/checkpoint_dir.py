"""The checkpoint folder as a whole: what this run may write into it, leftovers of crashes,
free space, and clean-up after a failed write (`comlrl/checkpoint.py` has the format).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

from comlrl.checkpoint import (
    _LEFTOVER, _NAME, JOURNAL, METADATA, STAGING_PREFIX, TRASH_PREFIX, CheckpointError,
    CheckpointWriteError, _checkpoint_names, _fsync_dir, _is_journal, checkpoint_size,
    list_checkpoints, read_checkpoint_metadata, read_owner, recover_interrupted_commits,
    remove_owned, staging_path,
)


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
    entries = _repaired_entries(d)
    resuming = resume_meta is not None
    run_uid = resume_meta.get("run_uid") if resuming else None
    whole, leftovers, colliding, foreign = _sort_entries(entries)
    _refuse_unusable(d, resuming, run_uid, whole, leftovers, colliding, foreign)


def _repaired_entries(d: Path) -> list[Path]:
    """The entries of folder `d` after `recover_interrupted_commits`, sorted; CheckpointError
    when `d` is not a folder or cannot be read or repaired."""
    if not d.is_dir():
        raise CheckpointError(f"checkpoint_dir {d} exists and is not a folder; pass a folder path "
                              f"(new or empty) as checkpoint_dir.")
    try:
        recover_interrupted_commits(d)
        return sorted(d.iterdir())
    except OSError as exc:
        raise CheckpointError(f"checkpoint_dir {d} cannot be read or repaired ({exc}); fix its "
                              f"permissions or pick another checkpoint_dir.") from exc


def _sort_entries(entries: list[Path]) -> tuple[list, list, list, list]:
    """Sort a checkpoint folder's entries by who wrote them: (whole, leftovers, colliding,
    foreign). whole: (name, run_uid) of our whole checkpoints; leftovers: (name, owner
    run_uid) of our half-written or half-deleted folders; colliding: foreign things under
    names we write, with the reason; foreign: anything else not ours. The journal is skipped."""
    whole: list[tuple[str, Any]] = []
    leftovers: list[tuple[str, str]] = []
    colliding: list[str] = []
    foreign: list[str] = []
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
    return whole, leftovers, colliding, foreign


def _refuse_unusable(d: Path, resuming: bool, run_uid: Any, whole: list, leftovers: list,
                     colliding: list, foreign: list) -> None:
    """Raise CheckpointError for the first rule the sorted entries of `d` break (see
    `check_checkpoint_dir`): collisions, then another run's checkpoints, then foreign files."""
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
            f"checkpoint_dir {d} already holds checkpoints of another run (run "
            f"{', '.join(uids)}: {', '.join(names[-3:])}). Pass resume_from_checkpoint={d / names[-1]} (or "
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
