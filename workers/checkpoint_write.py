"""Writing a checkpoint's large files: one pass over the bytes, hashed on the way, past the
page cache.

An ordinary write of a new file fills the page cache with fresh memory, which costs more
than hashing the bytes, and reading each file back to hash it costs as much again
(BENCHMARKS.md). `HashedWriter` writes with O_DIRECT, hashing the bytes as they pass:
block-aligned pieces straight from their own memory, the rest through one small aligned
buffer. The commit records that digest, so nothing is read back. Where O_DIRECT is refused
(some filesystems; macOS has none) the same buffer is written the ordinary way. Runs in the
learner actors; the digests themselves are `comlrl/digests.py`'s.
"""

from __future__ import annotations

import errno
import json
import os
import struct
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from comlrl.digests import ALIGN, BUFFER_BYTES, digest_of, drop_direct, give_back, new_hash, \
    open_direct, take_buffer


class HashedWriter:
    """A new binary file for writing (`write`, `tell`: what `torch.save` needs), hashed
    (`DIGEST`) as the bytes pass. Used as a context manager: on success the file is cut to
    its length, fsynced and closed, and `digest` holds the digest of everything written, as
    a checkpoint records it (`file_digest`'s); on an error it is only closed (the caller
    removes what it was writing into)."""

    def __init__(self, path: str | os.PathLike, direct: bool = True):
        self.fd, self.direct = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct)
        self.buffer = take_buffer()
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
                self.direct = drop_direct(self.fd)  # the rest goes through the buffer
        return pos

    def _flush(self, length: int) -> None:
        out = self.view[:length]
        while len(out):
            try:
                out = out[os.write(self.fd, out):]
            except OSError as exc:
                if not self.direct or exc.errno != errno.EINVAL:
                    raise                     # e.g. ENOSPC: the caller's error to explain
                self.direct = drop_direct(self.fd)  # refused only at the first write
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
            give_back(self.buffer)


_PATCH_LOCK = threading.Lock()


def torch_save_hashed(obj: Any, path: str | os.PathLike) -> str:
    """`torch.save(obj, path)` through a `HashedWriter`; returns the file's digest. Its zip
    records get no CRC-32: computing it was most of the save's CPU time (BENCHMARKS.md), and
    the digest already covers every byte. Each tensor's bytes start
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
