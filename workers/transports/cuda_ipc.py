"""Weights by CUDA IPC: engines on the learner's own GPU copy from its packed buckets."""

from __future__ import annotations

from typing import Any

from comlrl.config import DEFAULT_BUCKET_BYTES
from workers.transports.base import WeightTransport


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
