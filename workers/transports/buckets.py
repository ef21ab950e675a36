"""Weights in transit: the bucket layout both sides of a push derive, and the NumPy packing
the object store carries without copies of its own.
"""

from __future__ import annotations

import warnings
from typing import Any


def plan_layout(params: list[tuple[str, list[int], str]], bucket_bytes: int) -> dict:
    """Buckets for `params` [(name, shape, dtype name)], in order, one dtype per bucket.

    A bucket holds consecutive parameters up to `bucket_bytes`; a larger parameter gets a
    bucket to itself. Sender and receivers derive the same flat offsets from this layout.
    """
    import torch

    buckets: list[dict] = []
    for i, (name, shape, dtype) in enumerate(params):
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        last = buckets[-1] if buckets else None
        if last is None or last["dtype"] != dtype or \
                (last["bytes"] and last["bytes"] + nbytes > bucket_bytes):
            last = {"dtype": dtype, "params": [], "numel": 0, "bytes": 0}
            buckets.append(last)
        last["params"].append(i)
        last["numel"] += numel
        last["bytes"] += nbytes
    return {"names": [p[0] for p in params], "shapes": [list(p[1]) for p in params],
            "dtypes": [p[2] for p in params], "buckets": buckets}


def pack_bucket(tensors: list, bucket: dict, device: Any):
    """One flat tensor holding `tensors` (the bucket's parameters, in order)."""
    import torch

    flat = torch.empty(bucket["numel"], dtype=getattr(torch, bucket["dtype"]), device=device)
    offset = 0
    for t in tensors:
        n = t.numel()
        flat[offset:offset + n].copy_(t.detach().reshape(-1))
        offset += n
    return flat


def unpack_bucket(flat, layout: dict, bucket: dict) -> list[tuple[str, Any]]:
    """(name, view) pairs of a received flat bucket."""
    out, offset = [], 0
    for i in bucket["params"]:
        shape = layout["shapes"][i]
        n = 1
        for d in shape:
            n *= int(d)
        out.append((layout["names"][i], flat[offset:offset + n].view(shape)))
        offset += n
    return out


def pack_weights(state_dict: dict) -> dict:
    """CPU weights as {"weights": {name: (dtype, shape, uint8 NumPy array)}}: Ray moves NumPy
    arrays through the object store zero-copy on its own, without the warnings of its
    zero-copy torch mode. The arrays view the tensors; Ray copies them when it stores them."""
    import torch

    out = {}
    for name, t in state_dict.items():
        t = t.detach().to("cpu").contiguous()
        out[name] = (str(t.dtype).split(".")[-1], tuple(t.shape),
                     t.reshape(-1).view(torch.uint8).numpy())
    return {"weights": out}


def unpack_weights(packed: dict, copy: bool = True) -> dict:
    """`pack_weights`'s result as tensors. The arrays sit in read-only object-store memory,
    which torch cannot mark read-only: each tensor gets its own writable copy (one memcpy),
    so nothing (vLLM keeps some loaded tensors as they are) can write into shared memory.
    `copy=False` gives views of that memory, for a caller that only copies out of them."""
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return {name: torch.from_numpy(array.copy() if copy else array).view(
            getattr(torch, dtype)).reshape(shape) for name, (dtype, shape, array) in
            packed["weights"].items()}
