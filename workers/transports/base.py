"""The driver's side of a weight transport: one small interface every strategy implements."""

from __future__ import annotations

from typing import Any


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
