"""RolloutPool: every agent's rollout workers, and the one rule for a worker that dies.

The rule, shared by generation, weight push and sleep/wake: a worker found dead is replaced by
a new actor with the same arguments and placement bundle, given its agent's current weights,
and its call is done again. A worker that dies more than `MAX_RESTARTS_PER_CALL` times within
one call is not restarted again: the call fails, naming the worker. Requests carry their seeds,
so a redone generation draws the same samples (README.md, "What survives what").
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any, Callable

from workers.ray_calls import ActorFailure, first_line, is_alive, kill_actors, ray_get, start_actor

MAX_RESTARTS_PER_CALL = 2
"""Restarts of one worker within one call before the call gives up."""


class RolloutPool:
    def __init__(self, specs: dict[tuple[int, int], tuple], num_agents: int, per_agent: int,
                 hosts: bool = False, leaders: list[int] | None = None):
        """`specs[agent, index]` = (class, placement, *args): how to start (and restart) it.
        `hosts`: worker 0 of each agent is its learner's actor (`colocate`); its death is the
        learner's, so it is not restarted here but raised for `Session.heal`. `leaders[a]`:
        the agent whose host's engine is agent a's worker 0 (LoRA agents on one base share
        one, `workers.driver.actors.lora_engine_groups`); every host is in `hosts_of`."""
        self.specs = specs
        self.hosts = hosts
        self.leaders = list(leaders) if leaders is not None else list(range(num_agents))
        self.workers: list[list[Any]] = [
            [start_actor(*specs[a, i]) for i in range(per_agent)] for a in range(num_agents)]
        self.hosts_of: list[Any] = [ws[0] for ws in self.workers] if hosts else []
        self.rehost(self.hosts_of)
        self.learners: list[Any] = []
        self.transport: Any = None
        self.restarts = 0
        self.on_restart: Callable[[str], None] = lambda message: warnings.warn(message)

    @property
    def actors(self) -> list:
        """Every actor once (a shared engine's host is several agents' worker 0)."""
        out: list = []
        for actor in [w for ws in self.workers for w in ws] + self.hosts_of:
            if not any(actor is seen for seen in out):
                out.append(actor)
        return out

    @property
    def shared(self) -> bool:
        """Whether an engine serves the adapters of several agents."""
        return self.leaders != list(range(len(self.leaders)))

    def rehost(self, hosts: list) -> None:
        """`colocate`: every agent's worker 0 is the host whose engine serves it (new hosts
        after `Session.heal` restarted them)."""
        if not self.hosts:
            return
        self.hosts_of = list(hosts)
        for a, leader in enumerate(self.leaders):
            self.workers[a][0] = self.hosts_of[leader]

    def attach(self, learners: list, transport: Any) -> None:
        """Where current weights come from when a worker is restarted."""
        self.learners, self.transport = learners, transport

    # ---- the restart policy

    def _get(self, agent: int, index: int, ref: Any, redo: Callable[[], Any] | None,
             what: str) -> Any:
        """Wait for `ref` of worker (`agent`, `index`); if the worker died, restart it and
        wait for `redo()` instead (None: the restart itself was the redo)."""
        for attempt in range(MAX_RESTARTS_PER_CALL + 1):
            try:
                return ray_get(ref, f"rollout worker {index} of agent {agent} {what}")
            except ActorFailure as exc:
                if attempt == MAX_RESTARTS_PER_CALL:
                    raise ActorFailure(
                        f"rollout worker {index} of agent {agent} died "
                        f"{MAX_RESTARTS_PER_CALL + 1} times while {what}; not restarting it "
                        f"again. Last cause: {exc}") from exc
                self.restart(agent, index, exc)
                if redo is None:
                    return None
                ref = redo()
        raise AssertionError("unreachable")

    def restart(self, agent: int, index: int, cause: BaseException) -> None:
        """Replace worker `index` of `agent` by a new actor holding the current weights."""
        if self.hosts and index == 0:
            raise ActorFailure(f"the actor hosting agent {agent}'s learner and rollout worker 0 "
                               f"died: {first_line(cause)}") from cause
        old = self.workers[agent][index]
        kill_actors([old])
        new = start_actor(*self.specs[agent, index])
        self.workers[agent][index] = new
        ray_get(new.get_version.remote(), f"restarting rollout worker {index} of agent {agent}")
        if self.learners:
            learner = self.learners[agent]
            version = ray_get(learner.get_version.remote(), f"learner of agent {agent}")
            ray_get(self.transport.refresh(agent, learner, self.workers[agent], index, version),
                    f"pushing weights to restarted rollout worker {index} of agent {agent}")
        self.restarts += 1
        self.on_restart(f"rollout worker {index} of agent {agent} died ({first_line(cause)}); "
                        f"restarted it with the current weights (restart {self.restarts} of "
                        f"this run).")

    def dead(self, agent: int) -> list[int]:
        return [i for i, worker in enumerate(self.workers[agent]) if not is_alive(worker)]

    # ---- the calls

    def generate(self, requests_per_agent: list[list[dict]]) -> dict:
        """Every agent's requests in one round, split across that agent's workers.

        Returns {"outputs": [agent][request] samples, "tokens", "seconds",
        "policy_versions": {agent: weight version that drew its samples}}."""
        parts = []
        for agent, requests in enumerate(requests_per_agent):
            n_workers = len(self.workers[agent])
            size = math.ceil(len(requests) / n_workers) if requests else 0
            for index in range(n_workers):
                part = requests[index * size:(index + 1) * size]
                if part:
                    parts.append((agent, index, part))
        start = time.perf_counter()
        refs = [self.workers[a][i].generate.remote(part, a) for a, i, part in parts]
        results = [self._get(a, i, ref, lambda a=a, i=i, p=part:
                             self.workers[a][i].generate.remote(p, a), "generating")
                   for (a, i, part), ref in zip(parts, refs)]
        out: dict = {"outputs": [[] for _ in requests_per_agent], "tokens": 0,
                     "seconds": time.perf_counter() - start, "policy_versions": {}}
        for (agent, _, _), res in zip(parts, results):
            out["outputs"][agent].extend(res["outputs"])
            out["tokens"] += res["tokens"]
            out["policy_versions"][agent] = res["version"]
        return out

    def call_every_worker(self, method: str) -> None:
        """`method` (no arguments) on every worker at once, e.g. sleep / wake."""
        calls = [(a, i, getattr(w, method).remote())
                 for a, ws in enumerate(self.workers) for i, w in enumerate(ws)]
        for a, i, ref in calls:
            self._get(a, i, ref, lambda a=a, i=i: getattr(self.workers[a][i], method).remote(),
                      method)

    def push(self, versions: list[int]) -> None:
        """Every learner's current weights (at `versions`) to each of its agent's workers.

        A worker found dead is restarted, which gives it these same weights; an error while
        every worker is alive is a real error of the learner or an engine and is raised."""
        import ray

        refs = {a: self.transport.push(a, learner, self.workers[a], versions[a])
                for a, learner in enumerate(self.learners)}
        errors = {}
        for agent, agent_refs in refs.items():
            for ref in agent_refs:
                try:
                    ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - sorted out below
                    errors.setdefault(agent, exc)
        for agent, exc in errors.items():
            dead = self.dead(agent)
            if not dead:
                if isinstance(exc, ray.exceptions.RayActorError):
                    raise ActorFailure(f"pushing weights of agent {agent}: the learner died: "
                                       f"{exc}") from exc
                raise exc
            for index in dead:
                self._get(agent, index, self.workers[agent][index].get_version.remote(), None,
                          "receiving weights")

