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

Actor-side halves are mixins: `WorkerEndpoint` (a base of `RolloutWorker`), `LearnerEndpoint`
(added to the learner class at launch by `with_learner_endpoint`).
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

TRANSPORTS = ("auto", "object_store", "nccl", "cuda_ipc")
DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024


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
                   timeout_s: float = 300.0) -> "WeightTransport":
    """The transport object for a resolved name ('object_store', 'nccl' or 'cuda_ipc')."""
    if name == "object_store":
        return ObjectStoreTransport()
    if name == "nccl":
        return NcclBroadcastTransport(backend=backend, bucket_bytes=bucket_bytes,
                                      timeout_s=timeout_s)
    if name == "cuda_ipc":
        return CudaIpcTransport(bucket_bytes=bucket_bytes)
    if name == "colocated":                 # `colocate=True` (workers/colocated.py)
        return ColocatedTransport()
    raise ValueError(f"unknown weight transport {name!r}")


# ---------------------------------------------------------------------- bucket layout


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
    import warnings, torch  # noqa: E401

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return {name: torch.from_numpy(array.copy() if copy else array).view(
            getattr(torch, dtype)).reshape(shape) for name, (dtype, shape, array) in
            packed["weights"].items()}


def _node_info() -> dict:
    import ray

    return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address()}


def _gpu_uuid(index: int = 0) -> str | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_properties(index).uuid)


def _new_group(backend: str, host: str, port: int, prefix: str, rank: int, world: int,
               timeout_s: float, is_master: bool = False, store: Any = None):
    """A process group of its own (not torch.distributed's default group)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world, is_master, timeout=timeout)
    prefixed = dist.PrefixStore(prefix, store)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(prefixed, rank, world), store
    return dist.ProcessGroupGloo(prefixed, rank, world, timeout), store


def _broadcast(group: Any, tensor: Any) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


# ---------------------------------------------------------------------- actor halves


class LearnerEndpoint:
    """Sender half, mixed into the learner class (which holds `self.model`)."""

    _tx_store = None
    _tx_group = None
    _tx_ipc_buffers: list = []

    def node_info(self) -> dict:
        return {**_node_info(), "gpu_uuid": _gpu_uuid()}

    def export_weights(self, names: list[str] | None = None) -> dict:
        """This learner's weights for the object store (`pack_weights`): all of them, or
        those of `names` (one bucket of the pull back at the end of train())."""
        state = self.model.state_dict()
        if names is not None:
            missing = [n for n in names if n not in state]
            if missing:
                raise KeyError(f"agent {getattr(self, 'agent_index', '?')}: the learner's "
                               f"model has no weight(s) {missing[:3]}")
            state = {n: state[n] for n in names}
        return pack_weights(state)

    def export_to_file(self, names: list[str], path: str) -> int:
        """Write the raw bytes of the weights `names`, in order, into the file `path` (a
        tmpfs file the driver on this node reads next, `workers.learner.pull_weights`);
        returns the bytes written."""
        import torch

        state = self.model.state_dict()
        written = 0
        with open(path, "wb") as f:
            for name in names:
                t = state[name].detach().to("cpu").contiguous()
                written += f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        return written

    def transport_layout(self, bucket_bytes: int) -> dict:
        params = [(k, list(v.shape), str(v.dtype).split(".")[-1])
                  for k, v in self.model.state_dict().items()]
        return plan_layout(params, bucket_bytes)

    def transport_open(self) -> tuple[str, int]:
        """Host the rendezvous store on a free port of this node; returns (host, port)."""
        import ray
        import torch.distributed as dist

        if self._tx_store is None:
            host = ray.util.get_node_ip_address()
            self._tx_store = dist.TCPStore(host, 0, None, True,
                                           timeout=datetime.timedelta(seconds=300),
                                           wait_for_workers=False)
            self._tx_host = host
        return self._tx_host, int(self._tx_store.port)

    def transport_join(self, backend: str, prefix: str, world: int, timeout_s: float) -> None:
        """Join group `prefix` as rank 0 (blocks until every worker has joined)."""
        self._tx_group = None
        self._tx_backend = backend
        self._tx_group, _ = _new_group(backend, "", 0, prefix, 0, world, timeout_s,
                                       store=self._tx_store)

    def transport_broadcast(self, layout: dict) -> float:
        """Broadcast the current weights, one collective call per bucket."""
        import torch

        start = time.perf_counter()
        state = self.model.state_dict()
        device = "cuda" if self._tx_backend == "nccl" else "cpu"
        with torch.no_grad():
            for bucket in layout["buckets"]:
                tensors = [state[layout["names"][i]] for i in bucket["params"]]
                _broadcast(self._tx_group, pack_bucket(tensors, bucket, device))
        return time.perf_counter() - start

    def transport_ipc_handles(self, layout: dict) -> list:
        """CUDA IPC handles of freshly packed buckets (kept alive until the next call)."""
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        state = self.model.state_dict()
        device = next(iter(state.values())).device
        if device.type != "cuda":
            raise ValueError("weight_transport='cuda_ipc': the learner is not on a GPU; set "
                             "learner_num_gpus > 0 (or single_gpu=True) or another transport.")
        with torch.no_grad():
            self._tx_ipc_buffers = [
                pack_bucket([state[layout["names"][i]] for i in b["params"]], b, device)
                for b in layout["buckets"]]
        torch.cuda.synchronize(device)
        return [reduce_tensor(flat) for flat in self._tx_ipc_buffers]


class WorkerEndpoint:
    """Receiver half, a base of `RolloutWorker` (which holds `self.engine` and
    `self.engine_version`)."""

    _rx_group = None

    def node_info(self) -> dict:
        return {**_node_info(), "gpu_uuid": _gpu_uuid()}

    def transport_join(self, backend: str, host: str, port: int, prefix: str, rank: int,
                       world: int, timeout_s: float) -> None:
        self._rx_group = None
        self._rx_backend = backend
        self._rx_group, self._rx_store = _new_group(backend, host, port, prefix, rank, world,
                                                    timeout_s)

    def receive_broadcast(self, version: int, layout: dict) -> float:
        import torch

        start = time.perf_counter()
        device = "cuda" if self._rx_backend == "nccl" else "cpu"
        weights: dict = {}
        for bucket in layout["buckets"]:
            flat = torch.empty(bucket["numel"], dtype=getattr(torch, bucket["dtype"]),
                               device=device)
            _broadcast(self._rx_group, flat)
            weights.update(unpack_bucket(flat, layout, bucket))
        self._load(version, weights)
        return time.perf_counter() - start

    def receive_ipc(self, version: int, layout: dict, handles: list) -> float:
        import torch

        start = time.perf_counter()
        index = _local_index_of(layout.get("gpu_uuid"))
        weights: dict = {}
        for (rebuild, args), bucket in zip(handles, layout["buckets"]):
            args = list(args)
            args[6] = index  # storage_device: the learner's GPU as this process numbers it
            weights.update(unpack_bucket(rebuild(*args), layout, bucket))
        self._load(version, weights)
        del weights
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def _load(self, version: int, weights: dict) -> None:
        self.engine.load_weights(weights)
        self.engine_version = int(version)


def _local_index_of(uuid: str | None) -> int:
    import torch

    for i in range(torch.cuda.device_count()):
        if uuid is None or _gpu_uuid(i) == uuid:
            return i
    raise ValueError(f"weight_transport='cuda_ipc': this rollout worker does not see the "
                     f"learner's GPU ({uuid}); use 'nccl' or 'object_store'.")


def with_learner_endpoint(cls: type) -> type:
    """`cls` (the learner class) with the sender half of the transports added."""
    if issubclass(cls, LearnerEndpoint):
        return cls
    return type(cls.__name__, (cls, LearnerEndpoint), {"__module__": cls.__module__,
                                                       "__doc__": cls.__doc__})


# ---------------------------------------------------------------------- driver side


class WeightTransport:
    """Driver side: `connect` once per agent (and again after a worker restart), then `push`
    after every update. `push` returns Ray refs; the caller waits for them."""

    name = "base"

    def connect(self, agent: int, learner: Any, workers: list) -> None:
        """Set up whatever channel `push` needs between `learner` and `workers`."""

    def push(self, agent: int, learner: Any, workers: list, version: int) -> list:
        raise NotImplementedError

    def refresh(self, agent: int, learner: Any, workers: list, index: int,
                version: int) -> list:
        """Worker `index` was replaced by a new actor: reconnect and give it the weights."""
        self.connect(agent, learner, workers)
        return self.push(agent, learner, [workers[index]], version)


class ObjectStoreTransport(WeightTransport):
    """learner.export_weights -> Ray object store (one copy per node) -> update_weights."""

    name = "object_store"

    def push(self, agent: int, learner: Any, workers: list, version: int) -> list:
        weights = learner.export_weights.remote()
        return [w.update_weights.remote(version, weights) for w in workers]


class ColocatedTransport(ObjectStoreTransport):
    """Worker 0 of each agent is the learner's own host: it copies in-process. Any other
    worker of the agent gets the weights through the object store."""

    name = "colocated"

    def push(self, agent: int, learner: Any, workers: list, version: int) -> list:
        own = [learner.load_own_weights.remote(version)] if workers[:1] == [learner] else []
        others = [w for w in workers if w != learner]
        return own + (super().push(agent, learner, others, version) if others else [])


class NcclBroadcastTransport(WeightTransport):
    """The learner broadcasts packed buckets to all of its agent's workers in one group.

    `backend` is 'nccl' (learner and engines on GPUs) or 'gloo' (CPU tensors; what the tests
    run). A restart rebuilds the group under a new store prefix with every member.
    """

    name = "nccl"

    def __init__(self, backend: str = "nccl", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 timeout_s: float = 300.0):
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"broadcast backend must be 'nccl' or 'gloo' (got {backend!r}).")
        self.backend = backend
        self.bucket_bytes = int(bucket_bytes)
        self.timeout_s = float(timeout_s)
        self.layouts: dict[int, dict] = {}
        self.generation: dict[int, int] = {}

    def connect(self, agent: int, learner: Any, workers: list) -> None:
        import ray

        if agent not in self.layouts:
            self.layouts[agent] = ray.get(learner.transport_layout.remote(self.bucket_bytes))
        gen = self.generation.get(agent, -1) + 1
        self.generation[agent] = gen
        host, port = ray.get(learner.transport_open.remote())
        prefix, world = f"comlrl-weights/{agent}/{gen}", len(workers) + 1
        refs = [learner.transport_join.remote(self.backend, prefix, world, self.timeout_s)]
        refs += [w.transport_join.remote(self.backend, host, port, prefix, r + 1, world,
                                         self.timeout_s) for r, w in enumerate(workers)]
        ray.get(refs)

    def push(self, agent: int, learner: Any, workers: list, version: int) -> list:
        layout = self.layouts[agent]
        return [learner.transport_broadcast.remote(layout)] + \
            [w.receive_broadcast.remote(version, layout) for w in workers]

    def refresh(self, agent: int, learner: Any, workers: list, index: int,
                version: int) -> list:
        # A broadcast reaches the whole group: the survivors get the same weights again.
        self.connect(agent, learner, workers)
        return self.push(agent, learner, workers, version)


class CudaIpcTransport(WeightTransport):
    """Engines on the learner's GPU copy from the learner's packed buckets via CUDA IPC."""

    name = "cuda_ipc"

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.bucket_bytes = int(bucket_bytes)
        self.layouts: dict[int, dict] = {}

    def connect(self, agent: int, learner: Any, workers: list) -> None:
        import ray

        info = ray.get(learner.node_info.remote())
        for w, winfo in zip(workers, ray.get([w.node_info.remote() for w in workers])):
            if winfo["node_id"] != info["node_id"] or winfo["gpu_uuid"] != info["gpu_uuid"]:
                raise ValueError(
                    f"weight_transport='cuda_ipc' needs agent {agent}'s rollout workers on the "
                    f"learner's GPU (learner {info['gpu_uuid']} on node {info['node_id'][:8]}, "
                    f"worker {winfo['gpu_uuid']} on node {winfo['node_id'][:8]}); use "
                    f"single_gpu=True, or weight_transport='nccl'.")
        layout = ray.get(learner.transport_layout.remote(self.bucket_bytes))
        self.layouts[agent] = {**layout, "gpu_uuid": info["gpu_uuid"]}

    def push(self, agent: int, learner: Any, workers: list, version: int) -> list:
        import ray

        layout = self.layouts[agent]
        handles = ray.get(learner.transport_ipc_handles.remote(layout))
        return [w.receive_ipc.remote(version, layout, handles) for w in workers]
