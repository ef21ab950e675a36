"""Ray plumbing: join or start Ray, place the actors, and surface actor errors with tracebacks.

One code path for a laptop and a cluster: the trainer joins `ray_address` / RAY_ADDRESS when
given, otherwise starts a local Ray sized to this machine on loopback.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from comlrl.engines import ENGINE_ENV

# Local Ray stays on 127.0.0.1, without token auth (later `ray job submit` calls would get 401)
# and without usage reporting. Only defaults: a user's own settings win.
LOCAL_RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
}


class ActorFailure(RuntimeError):
    """A Ray actor died; the message says which one and why."""


def ensure_ray(address: str | None) -> bool:
    """Join `address` (or RAY_ADDRESS), else start a local Ray. Returns True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)
    env = {"env_vars": {**LOCAL_RAY_ENV, **ENGINE_ENV}}
    address = address or os.environ.get("RAY_ADDRESS")
    if address or os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        # Joining a cluster (or running as a `ray job submit` driver): pass no runtime env.
        # The job's own runtime env stays in force (Ray refuses to merge a conflicting one),
        # and every actor gets the engine variables through its own options anyway.
        try:
            ray.init(address=address or "auto", log_to_driver=True)
        except Exception as exc:  # ConnectionError, TimeoutError, ValueError by version
            raise ConnectionError(
                f"could not join the Ray cluster at ray_address={address!r} ({exc}). Start it "
                f"with `ray start --head`, fix the address (or RAY_ADDRESS), or leave both unset "
                f"to run on a local Ray."
            ) from exc
        return False
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, runtime_env=env,
             object_store_memory=512 * 1024 * 1024, log_to_driver=True)
    return True


def ray_get(refs: Any, what: str) -> Any:
    """`ray.get` that names the actor behind a failure.

    An exception raised inside an actor method comes back as RayTaskError, which is already an
    instance of the original class and carries the actor's traceback in its message; an actor
    that died (killed, out of memory, node lost) comes back as RayActorError and is re-raised
    as ActorFailure naming `what` and Ray's stated cause.
    """
    import ray
    from ray.exceptions import RayActorError

    try:
        return ray.get(refs)
    except RayActorError as exc:
        raise ActorFailure(f"{what}: the Ray actor died: {exc}") from exc


@dataclass
class Placement:
    """Ray resources of one actor."""

    num_cpus: float = 0.0
    num_gpus: float = 0.0
    resources: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)

    def options(self) -> dict:
        opts: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus,
                                "runtime_env": {"env_vars": {**ENGINE_ENV, **self.env}}}
        if self.resources:
            opts["resources"] = dict(self.resources)
        return opts


def check_resources(needs: list[tuple[str, Placement]]) -> None:
    """Fail at once, naming the setting, when the cluster can never hold every actor.

    Without this check an actor that asks for more than any node has stays pending forever.
    """
    import ray

    total = ray.cluster_resources()
    want: dict[str, float] = {}
    for _, p in needs:
        want["CPU"] = want.get("CPU", 0.0) + p.num_cpus
        want["GPU"] = want.get("GPU", 0.0) + p.num_gpus
        for k, v in p.resources.items():
            want[k] = want.get(k, 0.0) + v
    short = {k: (v, total.get(k, 0.0)) for k, v in want.items() if v > total.get(k, 0.0) + 1e-9}
    if short:
        detail = ", ".join(f"{k}: need {v:g}, cluster has {h:g}" for k, (v, h) in short.items())
        raise ValueError(
            f"the Ray cluster can never hold these actors ({detail}). Lower rollout_num_cpus / "
            f"rollout_num_gpus / learner_num_cpus / learner_num_gpus or "
            f"rollout_workers_per_agent, or add nodes."
        )


def start_actor(cls: type, placement: Placement, *args: Any, **kwargs: Any):
    """Start `cls` (a plain class) as a Ray actor with `placement`."""
    import ray

    return ray.remote(cls).options(**placement.options()).remote(*args, **kwargs)


def kill_actors(actors: list) -> None:
    import ray

    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass


def pack_model_folder(path: str) -> dict:
    """A saved model folder as {file name: bytes}, to ship through the object store.

    Actors on other nodes cannot read the driver's disk; they rebuild the folder locally with
    `materialize_model`.
    """
    from pathlib import Path

    folder = Path(path)
    return {"name": folder.name,
            "files": {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.is_file()}}


def materialize_model(source: str | dict) -> str:
    """A local folder for `source`: a path (or hub name) as is, or a packed folder written out."""
    import tempfile
    from pathlib import Path

    if isinstance(source, str):
        return source
    folder = Path(tempfile.mkdtemp(prefix=f"comlrl-{source['name']}-"))
    for name, data in source["files"].items():
        (folder / name).write_bytes(data)
    return str(folder)
