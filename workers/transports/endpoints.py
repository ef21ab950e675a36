"""The actor-side halves of the weight transports, as mixins: `WorkerEndpoint` (a base of
`RolloutWorker`) receives, `LearnerEndpoint` (added to the learner class at launch by
`with_learner_endpoint`) sends. The broadcast group leaves torch.distributed's default group
alone (an in-process vLLM engine owns it): a TCPStore hosted by the learner plus a process
group built directly, like vLLM's `StatelessProcessGroup`.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

from workers.transports.buckets import pack_bucket, pack_weights, plan_layout, unpack_bucket


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
    """Sender half, mixed into the learner class (whose `push_state()` is what it sends)."""

    _tx_store = None
    _tx_group = None
    _tx_ipc_buffers: list = []

    def node_info(self) -> dict:
        return {**_node_info(), "gpu_uuid": _gpu_uuid()}

    def export_weights(self, names: list[str] | None = None) -> dict:
        """This learner's weights for the object store (`pack_weights`): all of them, or
        those of `names` (one bucket of the pull back at the end of train())."""
        state = self.push_state()
        if names is not None:
            missing = [n for n in names if n not in state]
            if missing:
                raise KeyError(f"agent {getattr(self, 'agent_index', '?')}: the learner's "
                               f"model has no weight(s) {missing[:3]}")
            state = {n: state[n] for n in names}
        return pack_weights(state)

    def export_to_file(self, names: list[str], path: str) -> int:
        """Write the raw bytes of the weights `names`, in order, into the file `path` (a
        tmpfs file the driver on this node reads next, `workers.driver.hand_back.pull_weights`);
        returns the bytes written."""
        import torch

        state = self.push_state()
        written = 0
        with open(path, "wb") as f:
            for name in names:
                t = state[name].detach().to("cpu").contiguous()
                written += f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        return written

    def transport_layout(self, bucket_bytes: int) -> dict:
        params = [(k, list(v.shape), str(v.dtype).split(".")[-1])
                  for k, v in self.push_state().items()]
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
        state = self.push_state()
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

        state = self.push_state()
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
    """Receiver half, a base of `RolloutWorker` (which holds `self.engine`, its lock,
    `self.engine_version` and the versions of other agents it serves)."""

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

    def _other(self, agent: int | None) -> int | None:
        """`agent` if it is another agent than this worker's own, else None."""
        return None if agent is None or agent == self.agent_index else int(agent)

    def _load(self, version: int, weights: dict, agent: int | None = None) -> None:
        """Load `weights` as `version` of `agent` (None: this worker's own agent)."""
        other = self._other(agent)
        with self.engine_lock:
            self.engine.load_weights(weights, other)
        if other is None:
            self.engine_version = int(version)
        else:
            self.served_versions[other] = int(version)


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
