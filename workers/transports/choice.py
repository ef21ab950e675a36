"""Weight transports: how a learner's new weights reach its agent's rollout engines.

One small interface, three ways, picked by `MAGRPOConfig.weight_transport`:

- `ObjectStoreTransport` ("object_store"): the learner exports its weights as NumPy byte
  arrays (`pack_weights`), Ray's object store carries them (zero-copy on one node), every
  engine of the agent makes writable tensors of them (`unpack_weights`) and reloads them.
  Works everywhere; the only choice when learner or engines run on CPU.
- `NcclBroadcastTransport` ("nccl"): the learner (rank 0) and each of its agent's rollout
  workers (ranks 1..W) form one process group; the learner packs its parameters into flat
  buckets of `bucket_bytes` and broadcasts each bucket with ONE collective call (never one
  call per parameter). The group uses NCCL when both sides have GPUs and gloo otherwise, so
  the very same code runs (and is tested) on CPU.
- `CudaIpcTransport` ("cuda_ipc"): an engine on the learner's own GPU maps the learner's
  packed buckets through CUDA IPC handles and copies from them; no bytes cross a wire.

Both GPU transports stream into the engine's `load_weights` (vLLM `reload_weights`), so the
engine side is the same for all three. The group leaves torch.distributed's default group
alone (an in-process vLLM engine owns it): a TCPStore hosted by the learner plus a process
group built directly, like vLLM's `StatelessProcessGroup`. A tensor-parallel engine would
need vLLM's weight-transfer API (`vllm.distributed.weight_transfer`) to reach its other
ranks, which `resolve_transport` refuses rather than guess.

Each strategy is a file of this package; the actor-side halves are mixins in `endpoints.py`.
`colocate=True` adds a fourth way, `ColocatedTransport` (`object_store.py`).
"""

from __future__ import annotations

from comlrl.config import DEFAULT_BUCKET_BYTES, WEIGHT_TRANSPORTS as TRANSPORTS
from workers.transports.base import WeightTransport
from workers.transports.broadcast import NcclBroadcastTransport
from workers.transports.cuda_ipc import CudaIpcTransport
from workers.transports.object_store import ColocatedTransport, ObjectStoreTransport


def resolve_transport(name: str, *, learner_gpus: float, rollout_gpus: float,
                      single_gpu: bool = False, tensor_parallel_size: int = 1) -> str:
    """The transport `name` stands for with this placement.

    "auto": CUDA IPC when every actor shares one GPU (`single_gpu`), an NCCL broadcast when
    learners and engines both have GPUs, otherwise the object store. An explicit choice is
    kept, except that the GPU transports need single-rank engines.
    """
    if name not in TRANSPORTS:
        raise ValueError(f"weight_transport must be one of {', '.join(TRANSPORTS)} "
                         f"(got {name!r}).")
    if name == "auto":
        if tensor_parallel_size > 1 or learner_gpus <= 0 or rollout_gpus <= 0:
            return "object_store"
        return "cuda_ipc" if single_gpu else "nccl"
    if name in ("nccl", "cuda_ipc") and tensor_parallel_size > 1:
        raise ValueError(
            f"weight_transport={name!r} reaches engines with one rank only "
            f"(tensor_parallel_size={tensor_parallel_size}); use 'object_store' or 'auto'.")
    if name == "nccl" and single_gpu:
        raise ValueError("weight_transport='nccl' cannot join processes that share one GPU "
                         "(single_gpu); use 'cuda_ipc' or 'auto'.")
    if name == "cuda_ipc" and (learner_gpus <= 0 or rollout_gpus <= 0):
        raise ValueError("weight_transport='cuda_ipc' needs learner and rollout workers on a "
                         "GPU (learner_num_gpus > 0 and rollout_num_gpus > 0, or single_gpu).")
    return name


def make_transport(name: str, *, backend: str = "gloo", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                   timeout_s: float = 300.0) -> WeightTransport:
    """The transport object for a resolved name ('object_store', 'nccl' or 'cuda_ipc')."""
    if name == "object_store":
        return ObjectStoreTransport()
    if name == "nccl":
        return NcclBroadcastTransport(backend=backend, bucket_bytes=bucket_bytes,
                                      timeout_s=timeout_s)
    if name == "cuda_ipc":
        return CudaIpcTransport(bucket_bytes=bucket_bytes)
    if name == "colocated":                 # `colocate=True` (workers/roles/agent_host.py)
        return ColocatedTransport()
    raise ValueError(f"unknown weight transport {name!r}")
