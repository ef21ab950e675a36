"""Calling Ray actors: start one, get its results with failures named, probe, kill.

An actor's error comes back with the actor's traceback (`ray_get`); an actor that died comes
back as `ActorFailure` naming it and Ray's cause, a kill by Ray's memory monitor as one
sentence instead of Ray's page-long report (`oom_sentence`).
"""

from __future__ import annotations

import re
from typing import Any

from workers.console import redirect_output


class ActorFailure(RuntimeError):
    """A Ray actor died; the message says which one and why."""

    out_of_memory = False
    """Killed by Ray's memory monitor: restarting it would only be killed again."""


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
            failure = ActorFailure(oom_sentence(what, text))
            failure.ray_report, failure.out_of_memory = text, True
            raise failure from None
        raise ActorFailure(f"{what}: the Ray actor died: {exc}") from exc


_KILLED = re.compile(r"^Selected to kill: .*?task name=(?P<task>[\w.]+).*?pid=(?P<pid>\d+), "
                     r"actual memory used=(?P<used>[\d.]+)GB", re.MULTILINE)
_NODE = re.compile(r"was (?P<used>[\d.]+)GB used / (?P<limit>[\d.]+)GB limit")


def oom_sentence(what: str, report: str) -> str:
    """One sentence for a kill by Ray's memory monitor: which actor, its memory, the node's,
    and the fix, from Ray's `report` (a page: the object store, every worker, advice)."""
    killed = [m.groupdict() for m in _KILLED.finditer(report)]
    node = _NODE.search(report)
    who = ", ".join(f"{k['task'].split('.')[0]} (pid {k['pid']}, {float(k['used']):.1f} GB)"
                    for k in killed) or "an actor"
    where = (f" when the machine had {float(node['used']):.1f} of {float(node['limit']):.1f} "
             f"GB in use" if node else "")
    return (f"{what}: Ray's memory monitor killed {who}{where}; the run needs more memory "
            f"than this machine has: use engine_dtype='bfloat16', fewer or smaller agents, or "
            f"a machine with more memory (the estimate MAGRPOConfig(memory_check=True) prints "
            f"names the parts).")


def start_actor(cls: type, placement: Any, *args: Any, log_file: str | None = None,
                **kwargs: Any):
    """Start `cls` (a plain class) as a Ray actor with `placement` (a
    `workers.driver.placement.Placement`). With `log_file` (or `placement.log_file`) the
    actor's stdout and stderr go to that file (`logging_to`)."""
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


def is_alive(actor: Any) -> bool:
    """Whether `actor` (any of our roles) still answers; a busy one counts as alive."""
    import ray

    probe = actor.get_version if hasattr(actor, "get_version") else actor.free_space_warning
    try:
        ray.get(probe.remote(), timeout=60)
    except ray.exceptions.RayActorError:
        return False
    except ray.exceptions.GetTimeoutError:
        pass
    return True


def first_line(error: BaseException) -> str:
    """The first line of an error's message (Ray's carry the whole remote traceback)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
