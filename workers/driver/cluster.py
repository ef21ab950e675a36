"""The Ray a run uses: join a cluster, or start (and at exit stop) a local Ray on loopback.

One code path for a laptop and a cluster: the trainer joins `ray_address` / RAY_ADDRESS when
given, otherwise starts a local Ray sized to this machine. The warm-actor registry lives here
because its actors live and die with that local Ray.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import socket

from workers.engines import ENGINE_ENV

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
# zero-copy by itself (`workers.transports.buckets.pack_weights`).


# The local Ray this process started, if any: {"num_cpus", "object_store"}.
_LOCAL_RAY: dict = {}
# The actors a clean `train()` left running on that Ray for the next one ({"actors":
# workers.driver.actors.Actors}); they die with it.
WARM_ACTORS: dict = {}


def started_local_ray() -> bool:
    """Whether the Ray in use is a local one this process started (`ensure_ray`)."""
    return bool(_LOCAL_RAY)


def object_store_bytes(state_dict_bytes: int) -> int:
    """Object store for a local Ray: every agent's state dict twice (the pushed copy and the
    one being replaced while engines read) plus headroom, at least 512 MiB and at most a
    quarter of memory. A fixed 512 MiB spilled every push to disk at 76.6M parameters,
    several times slower than a push in memory (BENCHMARKS.md)."""
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
    if joins_cluster(address):
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
    # actor), the actors start sooner (`Placement.options`, BENCHMARKS.md).
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
    """At exit, stop the local Ray this process started sooner than Ray's own hook, which
    sleeps for late actor output (ours goes to files), then stops its processes one by one:
    the autoscaler monitor, idle on a local Ray, answers SIGTERM by reporting to a GCS
    already stopped and dies only at a SIGKILL a second later (BENCHMARKS.md, "exit s").
    Killed first, it loses nothing: the whole cluster stops next. (Its pid from Linux's /proc;
    elsewhere Ray's shutdown stops it as before.)"""
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


def joins_cluster(address: str | None) -> bool:
    """Whether `ensure_ray` joins a cluster instead of starting a local Ray: an address (or
    RAY_ADDRESS), or this process is a `ray job submit` driver."""
    return bool(address or os.environ.get("RAY_ADDRESS")
                or os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"))




def _check_reachable(address: str | None, timeout_s: float = 5.0) -> None:
    """Fail in seconds, not minutes, when nothing listens at a host:port Ray address.

    `ray.init` retries an unreachable GCS for minutes before it gives up.
    """
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
