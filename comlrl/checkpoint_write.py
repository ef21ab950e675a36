"""Writing a checkpoint's large files: one pass over the bytes, hashed on the way, past the
page cache.

On the VMs measured here an ordinary write of a new file costs 1.6-2.5 CPU-s per GB (every
page-cache page it fills is fresh guest memory), more than hashing it (sha256 0.85 CPU-s
per GB, xxh3 0.09), and the checkpointer then read each file back to hash it. `HashedWriter`
writes with O_DIRECT (~0.01 CPU-s per GB for the write itself), hashing the bytes as they
pass: block-aligned pieces straight from their own memory, the rest through one small
aligned buffer. The commit records that digest, so nothing is read back (BENCHMARKS.md).
Where O_DIRECT is refused (some filesystems; macOS has none) the same buffer is written the
ordinary way.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import struct
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

DIGEST = "xxh3_128"
"""How checkpoint files are hashed. The hash only has to notice a damaged or changed file,
and xxh3 does that at ~11 GB/s here against sha256's 1.2 GB/s: at 76.6M, sha256 of a
checkpoint's 1.84 GB was 1.6 of its 2.4 CPU-s (BENCHMARKS.md)."""


def new_hash() -> Any:
    """A hash object of this code's `DIGEST`; `digest_of` names its result."""
    import xxhash

    return xxhash.xxh3_128()


def digest_of(h: Any) -> str:
    return f"{DIGEST}:{h.hexdigest()}"


def file_digest(path: Path, scheme: str = DIGEST, direct: bool = False) -> str:
    """The file's digest as a checkpoint records it, made with `scheme`. `direct` reads past
    the page cache (O_DIRECT), for files nobody reads next: filling the cache with fresh
    guest memory cost 1.7 CPU-s per GB here, an O_DIRECT read 0.05. Where O_DIRECT is
    refused (tmpfs, macOS) the file is read the ordinary way."""
    h = new_hash() if scheme == DIGEST else hashlib.sha256()
    fd, direct = _open_direct(path, os.O_RDONLY, direct)
    buffer = _take_buffer()
    view = memoryview(buffer)
    try:
        while True:
            try:
                n = os.readv(fd, [view])
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise
                direct = _drop_direct(fd)      # refused at the first read: nothing was read
                continue
            if not n:
                break
            h.update(view[:n])
    finally:
        os.close(fd)
        view.release()
        _give_back(buffer)
    return digest_of(h) if scheme == DIGEST else h.hexdigest()


def _open_direct(path: str | os.PathLike, flags: int, direct: bool = True) -> tuple[int, bool]:
    """`os.open(path, flags)`, with O_DIRECT if `direct` and the filesystem takes it;
    returns the descriptor and whether it is direct."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise                         # EINVAL: a filesystem that refuses O_DIRECT
    return os.open(path, flags, 0o644), False


def _drop_direct(fd: int) -> bool:
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


def _take_buffer() -> mmap.mmap:
    """A BUFFER_BYTES buffer, page-aligned (anonymous memory), for one file's reads or
    writes; `_give_back` keeps it for the next file. On these VMs memory the process has not
    touched lately costs ~1 s per GB to touch (and to give back): a new buffer for each of a
    checkpoint's files slowed a colocated 10M engine's generation by ~13 ms per file."""
    with _BUFFERS_LOCK:
        if _BUFFERS:
            return _BUFFERS.pop()
    return mmap.mmap(-1, BUFFER_BYTES)


def _give_back(buffer: mmap.mmap) -> None:
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


class HashedWriter:
    """A new binary file for writing (`write`, `tell`: what `torch.save` needs), hashed
    (`DIGEST`) as the bytes pass. Used as a context manager: on success the file is cut to
    its length, fsynced and closed, and `digest` holds the digest of everything written, as
    a checkpoint records it (`file_digest`'s); on an error it is only closed (the caller
    removes what it was writing into)."""

    def __init__(self, path: str | os.PathLike, direct: bool = True):
        self.fd, self.direct = _open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct)
        self.buffer = _take_buffer()
        self.view = memoryview(self.buffer)
        self.fill = 0
        self.written = 0
        self.hash = new_hash()
        self.digest: str | None = None

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.written

    def flush(self) -> None:
        """Nothing: O_DIRECT writes whole blocks, so the last partial one waits for the end."""

    def write(self, data: Any) -> int:
        data = memoryview(data).cast("B")
        self.hash.update(data)
        pos = self._write_in_place(data)
        while pos < len(data):
            n = min(len(data) - pos, BUFFER_BYTES - self.fill)
            self.view[self.fill:self.fill + n] = data[pos:pos + n]
            self.fill += n
            pos += n
            if self.fill == BUFFER_BYTES:
                self._flush(BUFFER_BYTES)
        self.written += len(data)
        return len(data)

    def _write_in_place(self, data: memoryview) -> int:
        """O_DIRECT straight from `data` when it lands on a block boundary of the file and
        its address is block-aligned (tensors of 2 MB and more are, in an actor:
        `THP_MEM_ALLOC_ENABLE`), after the whole blocks the buffer holds; returns how many
        leading bytes it wrote. The copy into the buffer it spares was most of what a write
        cost a colocated engine's generation (BENCHMARKS.md)."""
        import numpy as np

        n = len(data) - len(data) % ALIGN
        if not self.direct or self.written % ALIGN or n == 0 or \
                np.frombuffer(data, np.uint8).ctypes.data % ALIGN:
            return 0
        if self.fill:                         # whole blocks, since the offset is aligned
            self._flush(self.fill)
        pos = 0
        while pos < n and self.direct:
            try:
                pos += os.write(self.fd, data[pos:min(n, pos + (64 << 20))])
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = _drop_direct(self.fd)  # the rest goes through the buffer
        return pos

    def _flush(self, length: int) -> None:
        out = self.view[:length]
        while len(out):
            try:
                out = out[os.write(self.fd, out):]
            except OSError as exc:
                if not self.direct or exc.errno != errno.EINVAL:
                    raise                     # e.g. ENOSPC: the caller's error to explain
                self.direct = _drop_direct(self.fd)  # refused only at the first write
        self.fill = 0

    def __enter__(self) -> "HashedWriter":
        return self

    def __exit__(self, kind, *_: Any) -> None:
        try:
            if kind is None:
                if self.fill:
                    # The last block is padded to the alignment, then cut off by ftruncate.
                    pad = -self.fill % ALIGN if self.direct else 0
                    self.view[self.fill:self.fill + pad] = bytes(pad)
                    self._flush(self.fill + pad)
                os.ftruncate(self.fd, self.written)
                os.fsync(self.fd)
                self.digest = digest_of(self.hash)
        finally:
            os.close(self.fd)
            self.view.release()
            _give_back(self.buffer)


_PATCH_LOCK = threading.Lock()


def torch_save_hashed(obj: Any, path: str | os.PathLike) -> str:
    """`torch.save(obj, path)` through a `HashedWriter`; returns the file's digest. Its zip
    records get no CRC-32: that was 0.36 of 0.50 CPU-s for a 76.6M AdamW state (crc32 runs
    at 2.2 GB/s here), and the digest already covers every byte. Each tensor's bytes start
    on a block boundary of the file, so the writer can send them from the tensor itself.
    torch.load reads the file as any other. These settings are process-wide: set under the
    lock, put back right after."""
    import torch
    from torch.utils.serialization import config

    with HashedWriter(Path(path)) as f, _PATCH_LOCK:
        crc32, alignment = config.save.compute_crc32, config.save.storage_alignment
        config.save.compute_crc32, config.save.storage_alignment = False, ALIGN
        try:
            torch.save(obj, f)
        finally:
            config.save.compute_crc32, config.save.storage_alignment = crc32, alignment
    return f.digest


SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
                      "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
                      "uint8": "U8", "bool": "BOOL"}


def safetensors_save_hashed(tensors: dict, path: str | os.PathLike,
                            metadata: dict | None = None) -> str:
    """Write `tensors` as a safetensors file (8-byte header length, JSON header padded with
    spaces, then each tensor's bytes in order) through a `HashedWriter`, straight from the
    tensors' memory; returns its digest. `safetensors.torch.save` would first build the file
    in memory: three fresh copies cost more here than the page cache they spare. The data
    starts on a block boundary and tensors whose size is a whole number of blocks come first
    in their dtype, so those can go to disk from the tensor itself (`HashedWriter`)."""
    import torch

    def nbytes(t: Any) -> int:
        return t.numel() * t.element_size()

    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(),
                                           nbytes(tensors[k]) % ALIGN != 0, k))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        size = nbytes(t)
        header[name] = {"dtype": SAFETENSORS_DTYPES[str(t.dtype).removeprefix("torch.")],
                        "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)
    with HashedWriter(path) as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name in order:
            t = tensors[name].detach().to("cpu").contiguous().reshape(-1)
            f.write(t.view(torch.uint8).numpy() if t.numel() else b"")
    return f.digest


@contextmanager
def safetensors_hashed(digests: dict[str, str]) -> Iterator[None]:
    """While open, the safetensors files `save_pretrained` writes go through
    `safetensors_save_hashed`, and `digests` gets {file name: digest}. transformers looks
    `safe_save_file` up in its module on every call, so the name is swapped there for the
    block. A dtype safetensors names otherwise, or another transformers without that name,
    gets the usual writer (the commit then hashes the file). The lock keeps two writers of
    one process from swapping it at once."""
    from transformers import modeling_utils

    original = getattr(modeling_utils, "safe_save_file", None)
    if original is None:
        yield
        return

    def save_file(tensors: dict, filename: str, metadata: dict | None = None) -> None:
        if any(str(t.dtype).removeprefix("torch.") not in SAFETENSORS_DTYPES
               for t in tensors.values()):
            return original(tensors, filename, metadata=metadata)
        digests[Path(filename).name] = safetensors_save_hashed(tensors, filename, metadata)

    with _PATCH_LOCK:
        modeling_utils.safe_save_file = save_file
        try:
            yield
        finally:
            modeling_utils.safe_save_file = original
