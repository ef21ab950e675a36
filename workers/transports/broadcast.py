"""Weights by a bucketed broadcast from the learner to its agent's engines: NCCL between GPUs,
gloo on CPU (the same code, and what the tests run)."""

from __future__ import annotations

from typing import Any

from comlrl.config import DEFAULT_BUCKET_BYTES
from workers.transports.base import WeightTransport


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
