"""The end of a `train()`: the learners' final weights back into the user's model objects, a
bucket at a time, or mapped straight from the checkpoint's files when a learner's state is
exactly that checkpoint's.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

from comlrl.lora import is_peft_model, load_adapter_state
from workers.ray_calls import ray_get
from workers.transports.buckets import plan_layout, unpack_weights


PULL_BUCKET_BYTES = 128 * 1024 * 1024
"""How much of a learner's weights is in flight at once on their way back to the user's
model (two buckets: the one being read and the next, being written)."""


def pull_weights(learners: list, models: list, bucket_bytes: int | None = None) -> None:
    """Copy the learners' (Ray actors') final weights into `models`, a bucket at a time.

    Each weight of the user's model gets fresh memory filled from its learner's, so neither
    side ever holds a second copy of a whole model: one export of the whole state dict made
    each 358M agent host 1.4 GB larger, and was where Ray's memory monitor killed them. A
    learner on the driver's node writes each bucket into one of two tmpfs files that the
    driver reads straight into the new tensors. Through the object store, freed buckets stay
    until Ray's batched free (about a second), so most of a model would pile up there; that
    is the way only for a learner on another node."""
    import ray
    import torch

    bucket_bytes = bucket_bytes or PULL_BUCKET_BYTES
    here = ray.get_runtime_context().get_node_id()
    for agent, (learner, model) in enumerate(zip(learners, models)):
        what = f"learner of agent {agent}"
        if is_peft_model(model):      # a LoRA agent: its adapter alone, a few MB
            load_adapter_state(model, unpack_weights(ray_get(learner.export_weights.remote(),
                                                             what), copy=False), what)
            continue
        current = model.state_dict(keep_vars=True)
        theirs = ray_get(learner.transport_layout.remote(bucket_bytes), what)
        if dict(zip(theirs["names"], map(list, theirs["shapes"]))) != \
                {k: list(v.shape) for k, v in current.items()}:
            # Not the same architecture: the strict load names the difference.
            model.load_state_dict(unpack_weights(ray_get(learner.export_weights.remote(), what),
                                                 copy=False))
            continue
        first: dict[int, str] = {}        # tied weights are one tensor, pulled once
        for name, tensor in current.items():
            first.setdefault(id(tensor), name)
        dtypes = dict(zip(theirs["names"], theirs["dtypes"]))
        layout = plan_layout([(n, list(current[n].shape), dtypes[n]) for n in first.values()],
                             bucket_bytes)
        buckets = [[(layout["names"][i], getattr(torch, layout["dtypes"][i]))
                    for i in b["params"]] for b in layout["buckets"]]
        local = ray_get(learner.node_info.remote(), what)["node_id"] == here
        if local and os.path.isdir("/dev/shm"):
            _pull_through_files(learner, current, buckets, what)
        else:
            _pull_through_store(learner, current, buckets, what)


_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16",
                       "F64": "float64", "I64": "int64", "I32": "int32", "U8": "uint8",
                       "BOOL": "bool"}


def map_checkpoint_weights(model: Any, folder: Path) -> bool:
    """Point every weight of `model` at its bytes in `folder`'s safetensors files, mapped
    copy-on-write (a write to a weight copies that page, as with `from_pretrained`'s
    mapping). False, with the model unchanged, unless the files hold every weight of the
    model with its shape and dtype. Files removed later (an older checkpoint rotated out)
    stay readable through the mapping; this project never rewrites a checkpoint file."""
    import torch

    found: dict[str, Any] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        for name, info in header.items():
            dtype = getattr(torch, _SAFETENSORS_DTYPES.get(info.get("dtype", ""), ""), None) \
                if name != "__metadata__" else None
            if dtype is None:
                continue
            start, end = info["data_offsets"]
            count = (end - start) // torch.empty((), dtype=dtype).element_size()
            found[name] = torch.empty(info["shape"], dtype=dtype) if count == 0 else \
                torch.frombuffer(mapped, dtype=dtype, count=count,
                                 offset=8 + length + start).view(info["shape"])
    current = model.state_dict(keep_vars=True)
    first: dict[int, str] = {}
    for name, tensor in current.items():
        first.setdefault(id(tensor), name)
    if any(name not in found or found[name].shape != current[name].shape
           or found[name].dtype != current[name].dtype for name in first.values()):
        return False
    for name in first.values():
        current[name].data = found[name]
    return True


def _pull_through_files(learner: Any, current: dict, buckets: list, what: str) -> None:
    """The learner writes bucket i+1 into one tmpfs file while the driver reads bucket i
    from the other straight into the model's new tensors."""
    import torch

    with tempfile.TemporaryDirectory(prefix="comlrl-pull-", dir="/dev/shm") as folder:
        slots = [os.path.join(folder, f"bucket-{i}") for i in range(2)]
        pending = learner.export_to_file.remote([n for n, _ in buckets[0]], slots[0])
        for index, bucket in enumerate(buckets):
            ray_get(pending, what)
            if index + 1 < len(buckets):
                pending = learner.export_to_file.remote(
                    [n for n, _ in buckets[index + 1]], slots[(index + 1) % 2])
            with open(slots[index % 2], "rb") as f, torch.no_grad():
                for name, dtype in bucket:
                    target = current[name]
                    fresh = torch.empty_like(target)
                    raw = fresh if fresh.dtype == dtype else \
                        torch.empty(target.shape, dtype=dtype)
                    view = raw.reshape(-1).view(torch.uint8).numpy()
                    if f.readinto(view) != view.nbytes:
                        raise RuntimeError(f"{what}: the weights file of {name} is short")
                    if raw is not fresh:
                        fresh.copy_(raw)
                    target.data = fresh


def _pull_through_store(learner: Any, current: dict, buckets: list, what: str) -> None:
    """A bucket at a time through Ray's object store (`export_weights(names)`), the next one
    asked for while this one is copied."""
    import torch

    def ask(i: int) -> Any:
        return learner.export_weights.remote([n for n, _ in buckets[i]])

    pending = ask(0)
    for index in range(len(buckets)):
        packed = ray_get(pending, what)
        pending = ask(index + 1) if index + 1 < len(buckets) else None
        with torch.no_grad():
            for name, value in unpack_weights(packed, copy=False).items():
                fresh = torch.empty_like(current[name])
                fresh.copy_(value)
                current[name].data = fresh
        del packed

