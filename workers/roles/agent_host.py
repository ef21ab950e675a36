"""AgentHost: one agent's learner and its first rollout engine in one actor (`colocate=True`).

The split layout runs every learner and every engine in its own process; on a small machine
that is two imports of torch and transformers per agent and a weight push through the object
store after every update. A host imports them once, and the push to its own engine becomes an
in-process copy (`load_own_weights`). Further workers of the agent
(`rollout_workers_per_agent` > 1) stay separate actors and get the weights through the object
store (`workers.transports.object_store.ColocatedTransport`). The driver still sees one learner
and one worker 0 per agent: both are this actor's handle, so generation, updates, checkpoints
and resume are unchanged.

The engine is built first: vLLM reseeds the global RNGs while it starts, and the learner then
restores the RNG state the process began with (`Learner.__init__`). Engine and learner keep
their own thread counts, each set in the calling thread at the start of its calls
(`VllmEngine._ready`, `Learner._own_threads`): an engine that serves several agents' adapters
runs at the cores one engine gets, its learner at a learner's, so the learner computes what a
learner in its own process computes.
"""

from __future__ import annotations

import time
from typing import Any

from workers.engines import imports_without_gc
from workers.model_source import model_folder
from workers.roles.learner import Learner
from workers.roles.rollout_worker import RolloutWorker
from workers.transports.endpoints import LearnerEndpoint


class AgentHost(Learner, LearnerEndpoint, RolloutWorker):
    def __init__(self, agent_index: int, model_source: str | dict, engine: str, sampling: dict,
                 engine_kwargs: dict[str, Any], learner_kwargs: dict[str, Any]):
        with imports_without_gc():      # the engine's imports run inside one too
            import torch

        # The learner starts from the RNG state of a new process, as a learner in its own
        # process does, not from the state vLLM's seeding leaves (`Learner.__init__`).
        self.initial_rng = torch.random.get_rng_state()
        # One folder for both: a packed model is written out once, and removed after both
        # have loaded it.
        # engine None: a LoRA agent whose adapter another host's engine serves (one engine
        # per base, workers/driver/actors.lora_engine_groups); this host holds its learner.
        with model_folder(model_source) as folder:
            if engine is not None:
                RolloutWorker.__init__(self, agent_index, folder, engine, sampling, engine_kwargs)
            Learner.__init__(self, agent_index, folder, **learner_kwargs)

    def reinit(self, agent_index: int, model_source: str | dict, engine: str, sampling: dict,
               engine_kwargs: dict, learner_kwargs: dict) -> int:
        """Start the learner over from `model_source` (a warm host taken by a later train());
        the engine keeps running and gets the new weights by the push that follows."""
        return Learner.reinit(self, agent_index, model_source, **learner_kwargs)

    def load_own_weights(self, version: int) -> float:
        """The push to this host's engine: the learner's tensors, copied into the engine in
        this process (no serialization, no object store). Returns the seconds it took."""
        start = time.perf_counter()
        self._load(version, {k: v.detach() for k, v in self.push_state().items()})
        return time.perf_counter() - start
