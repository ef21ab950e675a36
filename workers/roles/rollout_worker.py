"""Rollout worker: hosts one generation engine for one agent and tags outputs with a version.

A plain class; `workers.ray_calls.start_actor` wraps it in `ray.remote`. Several workers may
serve one agent: the driver splits a step's prompts across them, and per-request seeds make the
samples the same whichever worker draws them. Weights arrive through `update_weights` (object
store) or the receive methods of `workers.transports.endpoints.WorkerEndpoint` (broadcast, CUDA
IPC).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from workers.console import problem
from workers.engines import make_engine, SamplingSettings
from workers.model_source import model_folder
from workers.transports.buckets import unpack_weights
from workers.transports.endpoints import WorkerEndpoint


class RolloutWorker(WorkerEndpoint):
    def __init__(self, agent_index: int, model_source: str | dict, engine: str, sampling: dict,
                 engine_kwargs: dict[str, Any]):
        self.agent_index = agent_index
        with model_folder(model_source) as path:      # the engine loads all of it here
            self.engine = make_engine(engine, path, SamplingSettings(**sampling),
                                      **engine_kwargs)
        self.engine.on_problem = self.problem
        self.engine_version = 0
        self.served_versions: dict[int, int] = {}
        """The weight version of every other agent whose adapter this engine also serves
        (LoRA agents on one base, workers/driver/actors.lora_engine_groups)."""
        self.engine_lock = threading.Lock()     # an agent host's calls run in two threads

    def problem(self, text: str) -> None:
        """Say `text` on the driver's console, once (`workers.console.problem`)."""
        problem(f"rollout worker of agent {self.agent_index}: {text}")

    def generate(self, requests: list[dict], agent: int | None = None) -> dict:
        """Samples for every request (of `agent`, whose adapter this engine may serve beside
        its own), the weight version that drew them, and timing."""
        start = time.perf_counter()
        other = self._other(agent)
        with self.engine_lock:
            outputs = self.engine.generate(requests, other) if requests else []
        version = self.engine_version if other is None else self.served_versions[other]
        return {"outputs": outputs, "version": version,
                "seconds": time.perf_counter() - start,
                "tokens": sum(len(s["token_ids"]) for out in outputs for s in out)}

    def update_weights(self, version: int, weights: dict, agent: int | None = None) -> float:
        """Load `weights` (a state dict, or `workers.transports.buckets.pack_weights` of one) as
        `version` of `agent` (None: this worker's own); returns the seconds it took."""
        start = time.perf_counter()
        if isinstance(weights.get("weights"), dict):
            weights = unpack_weights(weights)
        self._load(version, weights, agent)
        return time.perf_counter() - start

    def get_version(self) -> int:
        return self.engine_version

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        with self.engine_lock:
            return self.engine.prompt_logprobs(token_ids)

    def sleep(self) -> None:
        """Release the engine's GPU memory (vLLM sleep mode) while the learner trains."""
        if hasattr(self.engine, "sleep"):
            self.engine.sleep()

    def wake(self) -> None:
        """Take the GPU memory back (generate and update_weights also wake the engine)."""
        if hasattr(self.engine, "wake"):
            self.engine.wake()

    def shutdown(self) -> None:
        self.engine.shutdown()
