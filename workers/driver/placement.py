"""Placement: the Ray resources of every role, and the one placement group they run in.

`plan_placement` turns a config into each role's `Placement`; `check_resources` refuses at once
what the cluster can never hold, naming the setting; `place` reserves one bundle per actor.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

from workers.driver.cluster import joins_cluster, started_local_ray
from workers.engines import ENGINE_ENV
from workers.transports.choice import resolve_transport


@dataclass
class Placement:
    """Ray resources of one actor, and optionally the placement-group bundle it runs in."""

    num_cpus: float = 0.0
    num_gpus: float = 0.0
    resources: dict = field(default_factory=dict)
    group: Any = None
    bundle_index: int | None = None
    log_file: str | None = None
    """Where the actor's stdout/stderr go (`start_actor`); None: Ray's worker logs."""

    def bundle(self) -> dict[str, float]:
        """The placement-group bundle reserving exactly this actor's resources ({} if none)."""
        out = {"CPU": float(self.num_cpus), "GPU": float(self.num_gpus),
               **{k: float(v) for k, v in self.resources.items()}}
        return {k: v for k, v in out.items() if v > 0}

    def at(self, group: Any, bundle_index: int | None) -> "Placement":
        """This placement inside bundle `bundle_index` of placement group `group`."""
        return replace(self, group=group, bundle_index=bundle_index)

    def options(self) -> dict:
        opts: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if not started_local_ray():   # a local Ray we started has them (`ensure_ray`)
            opts["runtime_env"] = {"env_vars": dict(ENGINE_ENV)}
        if self.resources:
            opts["resources"] = dict(self.resources)
        if self.group is not None and self.bundle_index is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=self.bundle_index)
        return opts


def colocate_here(args: Any) -> bool:
    """Whether this run colocates (`MAGRPOConfig.colocate`): 'auto' means yes on a local Ray
    this process starts (or started) when no actor asks for a GPU and the weight transport
    is 'auto' or 'object_store'; a cluster, a Ray someone else started, or GPUs keep the
    split layout (the colocated one was measured on CPU only)."""
    if args.colocate != "auto":
        return bool(args.colocate)
    import ray

    local = started_local_ray() if ray.is_initialized() else not joins_cluster(args.ray_address)
    gpus = args.single_gpu or args.rollout_num_gpus > 0 or args.learner_num_gpus > 0
    return local and not gpus and args.weight_transport in ("auto", "object_store")


def plan_placement(args: Any, num_agents: int, colocate: bool | None = None) -> dict:
    """Resources of every role for config `args` (a MAGRPOConfig) and `num_agents` agents.

    Returns {"rollout": Placement, "learner": Placement, "strategy", "gpu_memory_utilization",
    "transport"}. The `single_gpu` preset puts every actor on one GPU: each of the
    num_agents * (rollout_workers_per_agent + 1) actors gets an equal fraction of it (rounded
    down so the fractions sum to at most 1), `gpu_memory_utilization` is the share of the GPU
    that all engines together may take (each engine gets its part), and the placement group is
    STRICT_PACK (one node). Otherwise actors get the configured resources and the group is
    PACK: as few nodes as hold them, so learner-to-engine pushes stay on one node's object
    store (or GPU) when they can, but spreading over nodes when they must, and honouring
    `rollout_resources` / `learner_resources` pins. (STRICT_PACK would refuse any run larger
    than one node; SPREAD would send every push over the network.) `colocate` (default:
    `args.colocate is True`) adds the "host" placement of `workers/roles/agent_host.py`.
    """
    n_engines = num_agents * args.rollout_workers_per_agent
    rollout_gpus, learner_gpus = args.rollout_num_gpus, args.learner_num_gpus
    memory = args.gpu_memory_utilization
    strategy = "PACK"
    if args.single_gpu:
        share = math.floor(1e4 / (n_engines + num_agents)) / 1e4
        rollout_gpus = learner_gpus = share
        memory = args.gpu_memory_utilization / n_engines
        strategy = "STRICT_PACK"
    transport = resolve_transport(args.weight_transport, learner_gpus=learner_gpus,
                                  rollout_gpus=rollout_gpus, single_gpu=args.single_gpu,
                                  tensor_parallel_size=args.tensor_parallel_size)
    plan = {
        "rollout": Placement(args.rollout_num_cpus, rollout_gpus, dict(args.rollout_resources)),
        "learner": Placement(args.learner_num_cpus, learner_gpus, dict(args.learner_resources)),
        "strategy": strategy, "gpu_memory_utilization": memory, "transport": transport,
    }
    if (args.colocate is True) if colocate is None else colocate:
        # A host (workers/roles/agent_host.py) reserves what its learner and its engine would.
        r, l = plan["rollout"], plan["learner"]
        plan["host"] = Placement(r.num_cpus + l.num_cpus, r.num_gpus + l.num_gpus, {
            k: r.resources.get(k, 0) + l.resources.get(k, 0) for k in {**r.resources,
                                                                         **l.resources}})
        plan["transport"] = "colocated"
    return plan


def _field_for(role: str, resource: str) -> str:
    if role == "host":              # a colocated host reserves both roles' resources
        return f"{_field_for('rollout', resource)} + {_field_for('learner', resource)}"
    if resource == "CPU":
        return f"{role}_num_cpus"
    if resource == "GPU":
        return f"{role}_num_gpus"
    return f"{role}_resources[{resource!r}]"


def find_infeasible(needs: list[tuple[str, Placement]], nodes: list[dict],
                    strategy: str = "PACK") -> str | None:
    """Why `needs` can never be placed on `nodes` (each a node's total resources), or None.

    Checks the cluster totals, then that each actor's bundle fits on some single node, and
    for STRICT_PACK that all of them fit on one node together.
    """
    total: dict[str, float] = {}
    for node in nodes:
        for k, v in node.items():
            total[k] = total.get(k, 0.0) + float(v)
    want: dict[str, float] = {}
    roles: dict[str, set] = {}
    for role, p in needs:
        for k, v in p.bundle().items():
            want[k] = want.get(k, 0.0) + v
            roles.setdefault(k, set()).add(role)
    short = {k: v for k, v in want.items() if v > total.get(k, 0.0) + 1e-9}
    if short:
        detail = ", ".join(
            f"{k}: need {v:g} in all, cluster has {total.get(k, 0.0):g} "
            f"({' / '.join(_field_for(r, k) for r in sorted(roles[k]))})"
            for k, v in short.items())
        return (f"the Ray cluster can never hold these actors ({detail}). Lower those "
                f"settings or rollout_workers_per_agent, or add nodes.")
    for role, p in needs:
        bundle = p.bundle()
        if not bundle or any(_fits(bundle, n) for n in nodes):
            continue
        too_big = [k for k, v in bundle.items()
                   if v > max((float(n.get(k, 0.0)) for n in nodes), default=0.0) + 1e-9]
        keys = too_big or list(bundle)
        detail = ", ".join(
            f"{_field_for(role, k)} asks for {k}={bundle[k]:g}, the largest node has "
            f"{max((float(n.get(k, 0.0)) for n in nodes), default=0.0):g}" for k in keys)
        what = "more than any node has" if too_big else "a combination no single node has"
        return (f"one {role} actor asks for {what} ({detail}); an actor runs on one node. "
                f"Lower it, or add a node that large.")
    if strategy == "STRICT_PACK":
        if not any(_fits(want, n) for n in nodes):
            return (f"single_gpu puts every actor on one node, and no node holds them all "
                    f"({', '.join(f'{k}={v:g}' for k, v in want.items())}); lower "
                    f"rollout_num_cpus / learner_num_cpus or rollout_workers_per_agent.")
    return None


def _fits(bundle: dict, node: dict) -> bool:
    return all(float(node.get(k, 0.0)) + 1e-9 >= v for k, v in bundle.items())


def check_resources(needs: list[tuple[str, Placement]], strategy: str = "PACK") -> None:
    """Fail at once, naming the setting, when the cluster can never hold every actor.

    Without this check an actor (or a placement group) that asks for more than any node has
    stays pending forever. On an autoscaling cluster, whose nodes appear on demand, set
    COMLRL_SKIP_RESOURCE_CHECK=1 and rely on the placement timeout instead.
    """
    import ray

    if os.environ.get("COMLRL_SKIP_RESOURCE_CHECK") == "1":
        return
    nodes = [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]
    problem = find_infeasible(needs, nodes, strategy)
    if problem:
        raise ValueError(problem)


def place(needs: list[tuple[str, Placement]], strategy: str, timeout_s: float):
    """Reserve one bundle per actor in one placement group; returns the placements to start
    the actors with (same order as `needs`) and the group (None if no actor needs anything).

    Waits at most `timeout_s` for the reservation, then fails naming the settings instead of
    leaving the run pending forever (resources held by other jobs, or bundles that do not
    pack onto the nodes together).
    """
    import ray
    from ray.util import placement_group, remove_placement_group

    bundles = [p.bundle() for _, p in needs]
    index, real = [], []
    for b in bundles:
        index.append(len(real) if b else None)
        if b:
            real.append(b)
    if not real:
        return [p for _, p in needs], None
    group = placement_group(real, strategy=strategy)
    if not group.wait(timeout_s):
        remove_placement_group(group)
        roles = sorted({x for r, _ in needs
                        for x in (("rollout", "learner") if r == "host" else (r,))})
        fields = ", ".join(f"{r}_num_cpus / {r}_num_gpus / {r}_resources" for r in roles)
        raise TimeoutError(
            f"Ray did not reserve resources for {len(real)} actors within {timeout_s:g} s "
            f"(placement_timeout_s; strategy {strategy}; bundles "
            f"{sorted({str(b) for b in real})}; available now "
            f"{ {k: v for k, v in ray.available_resources().items() if '/' not in k} }). "
            f"Other jobs may hold them, or the bundles do not fit onto the nodes together: "
            f"lower {fields} or rollout_workers_per_agent, or add nodes.")
    return [p.at(group, i) for (_, p), i in zip(needs, index)], group


def remove_placement(group: Any) -> None:
    if group is None:
        return
    from ray.util import remove_placement_group

    try:
        remove_placement_group(group)
    except Exception:
        pass
