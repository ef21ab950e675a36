"""What a run prints on the console, and where everything else goes.

At default verbosity the console gets a short header (output folder, model, actors started),
the trainer's progress bar, problems that need a person (once each, in plain words) and a
closing summary (checkpoints, the W&B run, `wandb sync` for offline runs, the actor logs).
Everything the actors print (vLLM, Ray, transformers, torch) goes to one log file per actor:
`start_actor(..., log_file=...)` makes the actor point its own stdout/stderr file descriptors
at that file (`redirect_output`) before its class imports vLLM or torch.

Full output, as before this module existed: COMLRL_VERBOSE=1 in the environment, or
`MAGRPOConfig(verbose="full")` (`full_output`). Then no actor is redirected.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

VERBOSE_ENV = "COMLRL_VERBOSE"
LOG_FOLDER = "logs"
PREFIX = "comlrl-split: "


def full_output(verbose: Any = None) -> bool:
    """True when everything should reach the console: COMLRL_VERBOSE is 1/true/yes/full, or
    `verbose` (MAGRPOConfig.verbose) is "full" or an int >= 2. `verbose=True` (the default)
    only means "show the progress bar"."""
    if os.environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes", "on", "full"):
        return True
    if isinstance(verbose, str):
        return verbose.strip().lower() == "full"
    return isinstance(verbose, int) and not isinstance(verbose, bool) and verbose >= 2


def say(text: str, file: Any = None) -> None:
    """One line for the person running the job, prefixed so it stands out in `ray job logs`."""
    print(f"{PREFIX}{text}", file=file or sys.stdout, flush=True)


# ---------------------------------------------------------------------- inside an actor

_CONSOLE_FD: int | None = None     # the actor's stderr before redirection (Ray streams it)
_SAID: set[str] = set()


def redirect_output(path: str | os.PathLike) -> str:
    """Point this process's stdout and stderr (the file descriptors, so C++ code, logging
    handlers and child processes follow) at `path`, appending. Returns the file used: when
    `path` cannot be written on this node (an output folder that is not shared storage),
    a file in this node's temp folder instead. `problem` still reaches the console."""
    global _CONSOLE_FD
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        target = Path(tempfile.gettempdir()) / "comlrl-split-logs" / target.name
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if _CONSOLE_FD is None:
        _CONSOLE_FD = os.dup(2)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    print(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()} on "
          f"{os.uname().nodename}: output of this actor ====", flush=True)
    return str(target)


def problem(text: str) -> None:
    """A problem a person must see, once per process: to the console (Ray streams an actor's
    original stderr to the driver) and to this process's log. Not redirected: stderr."""
    if text in _SAID:
        return
    _SAID.add(text)
    line = f"{PREFIX}WARNING: {text}\n".encode()
    if _CONSOLE_FD is not None:
        with contextlib.suppress(OSError):
            os.write(_CONSOLE_FD, line)
    with contextlib.suppress(OSError):
        sys.stderr.flush()
        os.write(2, line)


# ---------------------------------------------------------------------- the driver


class ActorLogs:
    """Where each actor's output goes: `folder/<role>[-agent<a>][-worker<i>].log`, or nowhere
    special (Ray's own worker logs, streamed to the console) with full output.

    The folder is `output_dir/logs`, else `logs` beside `checkpoint_dir`, else Ray's session
    log folder on this node (resolved once Ray is up)."""

    def __init__(self, folder: str | os.PathLike | None, full: bool = False):
        self.full = full
        self._folder = Path(folder) if folder else None

    @classmethod
    def for_run(cls, verbose: Any = None, checkpoint_dir: str | None = None,
                output_dir: str | None = None) -> "ActorLogs":
        folder = None
        if output_dir:
            folder = Path(output_dir) / LOG_FOLDER
        elif checkpoint_dir:
            folder = Path(checkpoint_dir).resolve().parent / LOG_FOLDER
        return cls(folder, full_output(verbose))

    @property
    def folder(self) -> Path | None:
        if self.full:
            return None
        if self._folder is None:
            self._folder = ray_log_folder() / "comlrl-split"
        return self._folder

    def path(self, role: str, agent: int | None = None, index: int | None = None) -> str | None:
        """The log file of one actor (None with full output: the actor keeps Ray's)."""
        if self.folder is None:
            return None
        name = role + (f"-agent{agent}" if agent is not None else "") + \
            (f"-worker{index}" if index is not None else "")
        return str(self.folder / f"{name}.log")

    def place(self, placement: Any, role: str, agent: int | None = None,
              index: int | None = None) -> Any:
        """`placement` (a workers.driver.placement.Placement) logging to this actor's file; a
        restarted actor started from it appends to the same file."""
        return replace(placement, log_file=self.path(role, agent, index))


def ray_log_folder() -> Path:
    """Ray's log folder for this session on this node (`/tmp/ray/session_*/logs`)."""
    try:
        import ray

        node = ray._private.worker.global_worker.node
        return Path(node.get_logs_dir_path())
    except Exception:  # noqa: BLE001 - Ray not started, or another Ray version

        return Path(tempfile.gettempdir()) / "comlrl-split-logs"


@contextlib.contextmanager
def quiet_progress_bars(full: bool = False) -> Iterator[None]:
    """Within: no transformers / huggingface_hub progress bars in this process (e.g. the
    "Writing model shards" bars of save_pretrained). No-op with full output."""
    if full:
        yield
        return
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def header(output: str | os.PathLike | None, model: str, actors: dict[str, int],
           logs: ActorLogs | None = None, file: Any = None, reused: bool = False) -> str:
    """The lines printed when a `train()` has started its actors (or, `reused`, taken those
    of this process's previous train()); returns them."""
    started = ", ".join(f"{n} {role}{'s' if n != 1 else ''}" for role, n in actors.items() if n)
    how = "reused from the previous train()" if reused else "started"
    lines = [f"checkpoints go to: {output}" if output else "checkpoints: none (no checkpoint_dir)",
             f"model: {model}",
             f"actors {how}: {started or 'none'}"
             + (f" (their output: {logs.folder})" if logs and logs.folder else "")]
    for line in lines:
        say(line, file)
    return "\n".join(lines)


def wandb_info(run: Any) -> dict | None:
    """What the summary says about a W&B run (a `wandb.Run`, or None): id, folder, offline.
    Read while the run is open: a finished run no longer knows its folder."""
    if run is None:
        return None
    folder = None
    with contextlib.suppress(Exception):
        folder = str(Path(run.dir).parent)
    offline = False
    with contextlib.suppress(Exception):
        offline = bool(run.offline)
    if not offline:
        with contextlib.suppress(Exception):
            offline = run.settings.mode in ("offline", "dryrun")
    return {"id": getattr(run, "id", None), "folder": folder, "offline": offline,
            "url": None if offline else getattr(run, "url", None)}


def summary(checkpoints: list[str], wandb: dict | None, logs: ActorLogs | None,
            checkpoint_dir: str | None = None, file: Any = None) -> str:
    """The closing lines of a `train()`: checkpoints written, the W&B run and its folder, the
    `wandb sync` command for an offline run, and where the actor logs are; returns them."""
    names = [Path(c).name for c in checkpoints]
    lines = [f"checkpoints written: {', '.join(names)} in {Path(checkpoints[0]).parent}"
             if names else "checkpoints written: none"
             + (f" (checkpoint_dir {checkpoint_dir})" if checkpoint_dir else "")]
    if wandb:
        where = wandb.get("url") or wandb.get("folder") or "?"
        lines.append(f"W&B run: {wandb.get('id')} ({where})")
        if wandb.get("offline") and wandb.get("folder"):
            # A resumed offline run has one folder per process; sync them all, in order.
            every = Path(wandb["folder"]).parent / f"offline-run-*-{wandb.get('id')}"
            lines.append(f"W&B run is offline; upload it with: wandb sync {every}")
    else:
        lines.append("W&B: off")
    if logs is not None and logs.folder is not None:
        lines.append(f"actor logs: {logs.folder}")
    else:
        lines.append("actor logs: on the console above (full output)")
    for line in lines:
        say(line, file)
    return "\n".join(lines)


def default_wandb_offline(section: dict | None) -> bool:
    """A batch job cannot answer W&B's login prompt: with a `wandb:` section but no key and no
    mode (section or WANDB_MODE), W&B runs offline (sync later with `wandb sync`). True if so."""
    if section is None or "mode" in section or os.environ.get("WANDB_MODE") \
            or os.environ.get("WANDB_API_KEY"):
        return False
    os.environ["WANDB_MODE"] = "offline"
    say("W&B: no WANDB_API_KEY or WANDB_MODE set, logging offline "
        "(set WANDB_MODE=online or wandb.mode=online to sync)")
    return True
