"""Checkpoint file digests: the hash a manifest records, and reading a file past the page
cache to check it. The driver verifies a checkpoint with these before a resume; the writers
in `workers/checkpoint_write.py` hash the same way as they write. The aligned buffers both
sides read and write through are kept here. Why O_DIRECT and xxh3: BENCHMARKS.md.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import threading
from pathlib import Path
from typing import Any

DIGEST = "xxh3_128"
"""How checkpoint files are hashed. The hash only has to notice a damaged or changed file,
and xxh3 does that far faster than sha256, whose hashing was most of a checkpoint's
CPU time (BENCHMARKS.md)."""


def new_hash() -> Any:
    """A hash object of this code's `DIGEST`; `digest_of` names its result."""
    import xxhash

    return xxhash.xxh3_128()


def digest_of(h: Any) -> str:
    return f"{DIGEST}:{h.hexdigest()}"


def file_digest(path: Path, scheme: str = DIGEST, direct: bool = False) -> str:
    """The file's digest as a checkpoint records it, made with `scheme`. `direct` reads past
    the page cache (O_DIRECT), for files nobody reads next: filling the cache with fresh
    guest memory costs far more than the read itself (BENCHMARKS.md). Where O_DIRECT is
    refused (tmpfs, macOS) the file is read the ordinary way."""
    h = new_hash() if scheme == DIGEST else hashlib.sha256()
    fd, direct = open_direct(path, os.O_RDONLY, direct)
    buffer = take_buffer()
    view = memoryview(buffer)
    try:
        while True:
            try:
                n = os.readv(fd, [view])
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise
                direct = drop_direct(fd)      # refused at the first read: nothing was read
                continue
            if not n:
                break
            h.update(view[:n])
    finally:
        os.close(fd)
        view.release()
        give_back(buffer)
    return digest_of(h) if scheme == DIGEST else h.hexdigest()


def open_direct(path: str | os.PathLike, flags: int, direct: bool = True) -> tuple[int, bool]:
    """`os.open(path, flags)`, with O_DIRECT if `direct` and the filesystem takes it;
    returns the descriptor and whether it is direct."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise                         # EINVAL: a filesystem that refuses O_DIRECT
    return os.open(path, flags, 0o644), False


def drop_direct(fd: int) -> bool:
    """Clear O_DIRECT on `fd` (a filesystem that refused a direct read or write); False."""
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
    return False


def file_sha256(path: Path) -> str:
    """sha256 of a file (model fingerprints, which checkpoints of every version compare)."""
    return file_digest(path, "sha256")


ALIGN = 4096
"""O_DIRECT wants the buffer's address, the file offset and each length aligned to the
device's logical block (512 or 4096 bytes)."""
BUFFER_BYTES = 8 << 20
KEPT_BUFFERS = 2
"""How many buffers a process keeps: a learner writes one file at a time, and the other
two of a driver's four verify readers are unmapped when done."""
_BUFFERS: list[mmap.mmap] = []
_BUFFERS_LOCK = threading.Lock()


def take_buffer() -> mmap.mmap:
    """A BUFFER_BYTES buffer, page-aligned (anonymous memory), for one file's reads or
    writes; `give_back` keeps it for the next file. On these VMs memory the process has not
    touched lately is slow to touch (and to give back): a new buffer for each of a
    checkpoint's files slowed a colocated engine's generation (BENCHMARKS.md)."""
    with _BUFFERS_LOCK:
        if _BUFFERS:
            return _BUFFERS.pop()
    return mmap.mmap(-1, BUFFER_BYTES)


def give_back(buffer: mmap.mmap) -> None:
    """Keep `buffer` for the next file; past KEPT_BUFFERS kept (a driver verifies with four
    readers at once) it is unmapped."""
    with _BUFFERS_LOCK:
        if len(_BUFFERS) < KEPT_BUFFERS:
            _BUFFERS.append(buffer)
            return
    try:
        buffer.close()
    except BufferError:    # a view still held (an error's traceback): unmapped when freed
        pass

