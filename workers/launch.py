"""Ray plumbing: join or start Ray, place the actors, and surface actor errors with tracebacks.

One code path for a laptop and a cluster: the trainer joins `ray_address` / RAY_ADDRESS when
given, otherwise starts a local Ray sized to this machine on loopback.
"""

from __future__ import annotations

import atexit
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

from comlrl.engines import ENGINE_ENV

# Local Ray stays on 127.0.0.1, without token auth (later `ray job submit` calls would get 401)
# and without usage reporting. Only defaults: a user's own settings win.
LOCAL_RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}
# No RAY_ENABLE_ZERO_COPY_TORCH_TENSORS: with it Ray warns (ZeroCopyTensorsWarning) on every
# tensor it serializes and hands receivers tensors over read-only object-store memory (NumPy's
# "not writable" warning). Weights travel as NumPy byte arrays instead, which Ray carries
# zero-copy by itself (`workers.transport.pack_weights`).


# The local Ray this process started, if any: {"num_cpus", "object_store"}.
_LOCAL_RAY: dict = {}
# The actors a clean `train()` left running on that Ray for the next one ({"actors":
# workers.actors.Actors}); they die with it.
WARM_ACTORS: dict = {}


class ActorFailure(RuntimeError):
    """A Ray actor died; the message says which one and why."""

    out_of_memory = False
    """Killed by Ray's memory monitor: restarting it would only be killed again."""


def object_store_bytes(state_dict_bytes: int) -> int:
    """Object store for a local Ray: every agent's state dict twice (the pushed copy and the
    one being replaced while engines read) plus headroom, at least 512 MiB and at most a
    quarter of memory. A fixed 512 MiB spilled every push to disk at 76.6M parameters (2 x
    306 MB), 2.4 s a push against 0.5-0.8 s in memory (BENCHMARKS.md)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    want = 2 * state_dict_bytes + 256 * 1024 * 1024
    return int(min(max(want, 512 * 1024 * 1024), total // 4))


def ensure_ray(address: str | None, state_dict_bytes: int = 0, cpus_needed: float = 0.0,
               quiet: bool = False) -> bool:
    """Join `address` (or RAY_ADDRESS), else start a local Ray whose object store fits
    `state_dict_bytes` (all agents' weights). Returns True if the Ray in use is a local one
    this process started (now, or for an earlier `train()` of the same process).

    A local Ray gets at least `cpus_needed` logical CPUs (the sum of the actors' num_cpus):
    Ray's CPU counts are scheduling labels, and a local user expects 3 agents, or several
    rollout workers per agent, to share a 2-core machine rather than be refused. Threads
    per actor are still sized to the real cores. A local Ray started for an earlier, smaller
    `train()` is restarted larger. A cluster is never resized: there the feasibility check
    (`check_resources`) speaks.

    `quiet`: Ray's own driver messages below WARNING ("Started a local Ray instance") are not
    printed. Actor output still streams to the driver (log_to_driver): actors started with a
    `log_file` send only their `workers.console.problem` lines there."""
    import logging

    import ray

    if ray.is_initialized():
        if not _LOCAL_RAY:
            return False
        if _LOCAL_RAY["num_cpus"] >= cpus_needed - 1e-9 and \
                _LOCAL_RAY["object_store"] >= object_store_bytes(state_dict_bytes):
            return True
        ray.shutdown()
        _LOCAL_RAY.clear()
        WARM_ACTORS.clear()
    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)
    address = address or os.environ.get("RAY_ADDRESS")
    if _joins_cluster(address):
        # Joining a cluster (or running as a `ray job submit` driver): pass no runtime env.
        # The job's own runtime env stays in force (Ray refuses to merge a conflicting one),
        # and every actor gets the engine variables through its own options anyway.
        _check_reachable(address)
        try:
            ray.init(address=address or "auto", log_to_driver=True,
                     logging_level=logging.WARNING if quiet else logging.INFO)
        except Exception as exc:  # ConnectionError, TimeoutError, ValueError by version
            raise ConnectionError(
                f"could not join the Ray cluster at ray_address={address!r} ({exc}). Start it "
                f"with `ray start --head`, fix the address (or RAY_ADDRESS), or leave both unset "
                f"to run on a local Ray."
            ) from exc
        return False
    # address="local": always a new local Ray, never one a `ray start` left on this machine
    # (joining that with num_cpus would fail).
    num_cpus = max(os.cpu_count() or 1, math.ceil(cpus_needed - 1e-9))
    store = object_store_bytes(state_dict_bytes)
    # The engine variables reach every worker through the environment the Ray processes
    # inherit, set only while ray.init starts them: with no runtime env to set up (job or
    # actor), five actors start ~0.8 s sooner here (`Placement.options`, BENCHMARKS.md).
    saved = {key: os.environ.get(key) for key in ENGINE_ENV}
    os.environ.update(ENGINE_ENV)
    try:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 object_store_memory=store, log_to_driver=True,
                 logging_level=logging.WARNING if quiet else logging.INFO)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    atexit.unregister(stop_local_ray)
    atexit.register(stop_local_ray)         # runs before Ray's own hook (registered earlier)
    _LOCAL_RAY.update(num_cpus=num_cpus, object_store=store)
    return True


def stop_local_ray() -> None:
    """At exit, stop the local Ray this process started ~1.5 s sooner than Ray's own hook,
    which sleeps 0.5 s for late actor output (ours goes to files), then stops its processes
    one by one: the autoscaler monitor, idle on a local Ray, answers SIGTERM by reporting to
    a GCS already stopped and dies only at a SIGKILL 1 s later. Killed first, it loses
    nothing: the whole cluster stops next. (Its pid from Linux's /proc; elsewhere Ray's
    shutdown stops it as before.)"""
    import ray

    if not (_LOCAL_RAY and ray.is_initialized()):
        return                  # a Ray someone else started, or one already shut down
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                monitor = b"ray/autoscaler/_private/monitor.py" in f.read()
            if parent == os.getpid() and monitor:
                os.kill(int(entry), 9)      # SIGKILL
        except (OSError, ValueError, IndexError):
            continue            # not a process, or one gone meanwhile
    ray.shutdown()


def _joins_cluster(address: str | None) -> bool:
    """Whether `ensure_ray` joins a cluster instead of starting a local Ray: an address (or
    RAY_ADDRESS), or this process is a `ray job submit` driver."""
    return bool(address or os.environ.get("RAY_ADDRESS")
                or os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"))


def ray_get(refs: Any, what: str) -> Any:
    """`ray.get` that names the actor behind a failure.

    An exception raised inside an actor method comes back as RayTaskError, which is already an
    instance of the original class and carries the actor's traceback in its message; an actor
    that died (killed, out of memory, node lost) comes back as RayActorError and is re-raised
    as ActorFailure naming `what` and Ray's stated cause.
    """
    import ray
    from ray.exceptions import OutOfMemoryError, RayActorError

    try:
        return ray.get(refs)
    except (OutOfMemoryError, RayActorError) as exc:
        text = str(exc)
        if isinstance(exc, OutOfMemoryError) or "low on memory" in text:
            # Ray's report is a page (the object store, every worker, its advice): one
            # sentence instead; the page stays on the exception for whoever wants it.
            from workers.memory import oom_sentence

            failure = ActorFailure(oom_sentence(what, text))
            failure.ray_report, failure.out_of_memory = text, True
            raise failure from None
        raise ActorFailure(f"{what}: the Ray actor died: {exc}") from exc


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
        if not _LOCAL_RAY:   # a local Ray we started has them (`ensure_ray`)
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

    local = bool(_LOCAL_RAY) if ray.is_initialized() else not _joins_cluster(args.ray_address)
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
    `args.colocate is True`) adds the "host" placement of `workers/colocated.py`.
    """
    from workers.transport import resolve_transport

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
        # A host (workers/colocated.py) reserves what its learner and its engine would.
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


def start_actor(cls: type, placement: Placement, *args: Any, log_file: str | None = None,
                **kwargs: Any):
    """Start `cls` (a plain class) as a Ray actor with `placement`. With `log_file` (or
    `placement.log_file`) the actor's stdout and stderr go to that file (`logging_to`)."""
    import ray

    log_file = log_file or placement.log_file
    options = placement.options()
    if getattr(cls, "ray_max_concurrency", 1) > 1:
        options["max_concurrency"] = cls.ray_max_concurrency
    if log_file:
        cls = logging_to(cls, log_file)
    return ray.remote(cls).options(**options).remote(*args, **kwargs)


def logging_to(cls: type, log_file: str) -> type:
    """`cls` whose instances first point their process's stdout/stderr file descriptors at
    `log_file` (`workers.console.redirect_output`), then run `cls.__init__`: everything the
    actor prints from then on, vLLM's and torch's C++ output included, lands in the file.
    The actor classes import vLLM and torch inside `__init__`, so that output is caught too."""
    original = cls.__init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from workers.console import redirect_output

        self.log_file = redirect_output(log_file)
        original(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                       "__doc__": cls.__doc__})


def kill_actors(actors: list) -> None:
    import ray

    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass


def _check_reachable(address: str | None, timeout_s: float = 5.0) -> None:
    """Fail in seconds, not minutes, when nothing listens at a host:port Ray address.

    `ray.init` retries an unreachable GCS for minutes before it gives up.
    """
    import socket

    if not address or address == "auto" or ":" not in address:
        return
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return
    except (OSError, ValueError) as exc:
        raise ConnectionError(
            f"could not reach the Ray cluster at ray_address={address!r} ({exc}). Start it with "
            f"`ray start --head`, fix the address (or RAY_ADDRESS), or leave both unset to run "
            f"on a local Ray."
        ) from exc
