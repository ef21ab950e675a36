"""Weights through Ray's object store (any placement, the only way on CPU), and the colocated
host's in-process copy to its own engine."""

from __future__ import annotations

from typing import Any

from workers.transports.base import WeightTransport


class ObjectStoreTransport(WeightTransport):
    """learner.export_weights -> Ray object store (one copy per node) -> update_weights."""

    name = "object_store"

    def push(self, agent: int, learner: Any, workers: list, version: int) -> list:
        weights = learner.export_weights.remote()
        return [w.update_weights.remote(version, weights, agent) for w in workers]


class ColocatedTransport(ObjectStoreTransport):
    """Worker 0 of each agent is the learner's own host: it copies in-process. Any other
    worker of the agent gets the weights through the object store."""

    name = "colocated"

    def push(self, agent: int, learner: Any, workers: list, version: int) -> list:
        own = [learner.load_own_weights.remote(version)] if workers[:1] == [learner] else []
        others = [w for w in workers if w != learner]
        return own + (super().push(agent, learner, others, version) if others else [])
