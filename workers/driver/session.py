"""Session: everything one `train()` (or `evaluate()`) call runs on Ray, started and stopped.

It starts (or joins) Ray, places the actors (workers/driver/actors.py), connects the weight
transport, restores a checkpoint, opens the driver's W&B run, and stops all of it, whatever
happened. The loop calls its verbs: `generate`, `update_and_push`, `log_step`,
`save_checkpoint`. The map of who owns what is docs/architecture.md."""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from comlrl import magrpo
from comlrl.checkpoint import (
    CheckpointWriteError,
    list_checkpoints,
    read_checkpoint_metadata,
    verify_checksums,
)
from comlrl.config import RESUMABLE_FIELDS
from comlrl.fingerprints import compare_fingerprints
from comlrl.metrics import step_metrics
from comlrl.rollout import learner_group, Node, StepRecord
from comlrl.wandb_run import open_wandb_run
from workers import console
from workers.driver.actors import (
    actor_needs,
    actor_settings,
    Actors,
    connect_transport,
    drop_warm,
    lora_engine_groups,
    share_engines,
    park,
    reinit_learners,
    save_models,
    start_actors,
    take_warm,
    use_folders,
    warm_key,
    warm_learners_hold,
)
from workers.driver.cluster import ensure_ray
from workers.driver.hand_back import map_checkpoint_weights, pull_weights
from workers.driver.memory import preflight
from workers.driver.placement import (
    check_resources,
    colocate_here,
    Placement,
    plan_placement,
    remove_placement,
)
from workers.ray_calls import ActorFailure, first_line, is_alive, kill_actors, ray_get, start_actor
from workers.roles.checkpointer import Checkpointer


@dataclass
class Progress:
    """The session's counters: what a checkpoint records of the loop besides the trainer's
    env_step, written by `Session.save_checkpoint` and comlrl's manual save and read back on
    a resume and on a heal, all through `to_metadata` / `from_metadata`."""

    epoch: int = 0
    """Completed epochs (the loop sets it as each epoch ends)."""
    learner_updates: int = 0
    """Updates every learner has taken in this run (seeds each update's shuffle)."""
    last_train_log: int = -1
    """env_step of the last training point sent to W&B (`logging_steps` counts from it)."""

    def to_metadata(self, env_step: int) -> dict:
        """The counters under a checkpoint metadata's names, with the trainer's env_step."""
        return {"env_step": env_step, "epoch": self.epoch, "update_index": self.learner_updates,
                "last_train_log": self.last_train_log}

    @classmethod
    def from_metadata(cls, meta: dict) -> tuple["Progress", int]:
        """The counters and env_step a checkpoint's metadata holds; {} is a fresh start."""
        return cls(int(meta.get("epoch", 0)), int(meta.get("update_index", 0)),
                   int(meta.get("last_train_log", -1))), int(meta.get("env_step", 0))


class Session:
    def __init__(self, trainer: Any, checkpoint_dir: str | None = None,
                 total_limit: int | None = None, resume_path: str | None = None,
                 resume_meta: dict | None = None, for_eval: bool = False):
        self.trainer = trainer
        self.checkpoint_dir = checkpoint_dir
        self.total_limit = total_limit
        self.resume_path = resume_path
        self.resume_meta = resume_meta
        self.for_eval = for_eval
        self.progress = Progress()          # the counters a checkpoint records
        self.engine_versions = [0] * trainer.num_agents  # weight version each agent's engines hold
        self.pending_metrics: dict = {}     # events (e.g. restarts) riding with the next point
        self.run_uid: str | None = None
        self.fingerprints: dict = {}
        self.tmp: tempfile.TemporaryDirectory | None = None
        self.saving = None              # the models being saved into self.tmp (a Future)
        self.placement_group = None
        self.pool = None
        self.learners: list = []
        self.checkpointer = None
        self.transport = None
        self.wandb = None
        self.opening_wandb = None           # a Future of the W&B run, while it starts
        self.pending_checkpoint = None
        self.started_ray = False
        self.learner_specs: list = []
        self.logs = None                    # workers.console.ActorLogs: where actors print
        self.written: list[str] = []        # checkpoints this train() published
        self.wandb_info: dict | None = None  # the W&B run, for the closing summary
        self.actor_restarts = 0             # learner/checkpointer restarts (`heal`)
        self.actor_key = ""                 # what shaped the actors (actors.warm_key)

    @property
    def workers(self) -> list[list]:
        return self.pool.workers if self.pool is not None else []

    @property
    def actors(self) -> list:
        extra = [self.checkpointer] if self.checkpointer is not None else []
        return (self.pool.actors if self.pool else []) + self.learners + extra

    # ---- start / stop

    def __enter__(self) -> "Session":
        try:
            self._start()
        except BaseException as error:
            self.__exit__(type(error), error, error.__traceback__)   # a failed start, not 0
            raise
        return self

    def _start(self) -> None:
        """Start everything a train() (or evaluate()) runs on, in an order that refuses a
        bad resume before anything starts and overlaps what waits on other processes."""
        trainer, args = self.trainer, self.trainer.args
        # Actor output goes to a log file per actor unless full output is asked for.
        self.logs = console.ActorLogs.for_run(args.verbose, self.checkpoint_dir)
        self._check_resume(self._save_models_and_open_wandb())
        plan, warm = self._place_actors()
        self.pool.restarts, self.pool.on_restart = 0, self._on_worker_restart
        meta = self.resume_meta
        if warm is not None and (meta is None or warm.models != self.fingerprints["models"]):
            # Taken warm: the learners start over from this run's models (a resume then
            # loads its checkpoint over them; the reference model stays this run's).
            reinit_learners(self.learners, self.learner_specs)
        if self.checkpoint_dir and not self.for_eval:
            self._start_checkpointer(fresh=meta is None)
        elif self.checkpointer is not None:        # a warm one this run has no use for
            kill_actors([self.checkpointer])
            self.checkpointer = None
        ray_get([w.get_version.remote() for w in self.pool.actors + self.learners],
                "starting rollout workers and learners")
        if not self.for_eval:
            n_workers, hosts = trainer.num_agents * args.rollout_workers_per_agent, \
                self.pool.hosts * trainer.num_agents
            engines = self.pool.hosts * len(set(self.pool.leaders))
            console.header(Path(self.checkpoint_dir).resolve() if self.checkpoint_dir
                           else None, trainer.model_name,
                           {"learner+engine host": engines, "learner host": hosts - engines,
                            "rollout worker": n_workers - hosts,
                            "learner": len(self.learners) * (not self.pool.hosts),
                            "checkpointer": int(self.checkpointer is not None)}, self.logs,
                           reused=warm is not None)
        if self.transport is None:
            self.transport = connect_transport(args, plan, self.learners, self.workers)
        self.pool.attach(self.learners, self.transport)
        self._restore_learners(warm)
        self.wandb = self.opening_wandb.result()
        self.wandb.catch_sigterm()
        self.wandb_info = console.wandb_info(self.wandb.run)   # its folder, while it is open

    def _save_models_and_open_wandb(self) -> Future:
        """Start, in the background, saving the driver's models into folders (the actors
        load them from there; hashed on the way) and opening W&B; both mostly wait on other
        processes while Ray starts. W&B waits on the returned future, which `_check_resume`
        settles: a changed model or file is refused before the W&B run is touched."""
        helper, checked = ThreadPoolExecutor(2), Future()
        self.tmp = tempfile.TemporaryDirectory(prefix="comlrl-split-")
        self.saving = helper.submit(save_models, self.trainer, self.tmp.name, self.logs.full)
        self.opening_wandb = helper.submit(open_wandb_run, self.trainer, self.resume_meta,
                                           self.checkpoint_dir, checked.result)
        helper.shutdown(wait=False)
        return checked

    def _check_resume(self, checked: Future) -> None:
        """Verify a resume's checkpoint files and fingerprints and restore the counters (a
        fresh run starts them at zero), then let W&B go on, or hand it the refusal."""
        args, meta = self.trainer.args, self.resume_meta
        try:
            if meta is not None:
                verify_checksums(self.resume_path, meta, warm_learners_hold(meta["files"]))
                folders, self.fingerprints = self.saving.result()
                compare_fingerprints(meta["fingerprints"], self.fingerprints, RESUMABLE_FIELDS,
                                     skip_callables=args.skip_callable_fingerprints)
                self._restore_progress(meta)
                self.run_uid = meta["run_uid"]
            elif not self.for_eval:  # evaluate() logs at the env_step training reached
                self._restore_progress({})
                self.run_uid = f"{time.time_ns():x}"
            if self.progress.epoch > args.num_train_epochs:
                raise ValueError(f"num_train_epochs={args.num_train_epochs} is below the "
                                 f"{self.progress.epoch} epochs the checkpoint already "
                                 f"completed; num_train_epochs counts the whole run.")
        except BaseException as error:
            checked.set_exception(error)
            raise
        checked.set_result(None)

    def _place_actors(self) -> tuple[dict, Any]:
        """Join or start Ray, then take this process's parked actors if they were built the
        same way, else start new ones (refused first if this machine cannot hold them).
        Returns the placement plan and the warm actors taken (None: new ones)."""
        import ray

        trainer, args = self.trainer, self.trainer.args
        weight_bytes = sum(p.numel() * p.element_size() for m in trainer._initial_models()
                           for p in m.state_dict().values())
        # One placement-group bundle per actor (`plan_placement` says why PACK, or
        # STRICT_PACK for single_gpu); impossible requests fail here, naming the setting.
        plan = plan_placement(args, trainer.num_agents, colocate_here(args))
        needs = actor_needs(args, plan, trainer.num_agents, self.for_eval)
        self.started_ray = ensure_ray(args.ray_address, weight_bytes,
                                      sum(p.num_cpus for _, p in needs),
                                      quiet=not self.logs.full)
        folders, self.fingerprints = self.saving.result()
        check_resources(needs, plan["strategy"])
        # Threads follow the real cores of a Ray we started (its CPU count may be larger).
        cores = max(1, (os.cpu_count() or 1) if self.started_ray
                    else int(ray.cluster_resources().get("CPU", 1)))
        n_workers = trainer.num_agents * args.rollout_workers_per_agent
        settings = actor_settings(trainer, plan, cores, n_workers)
        leaders = lora_engine_groups(trainer, folders, settings,
                                     "host" in plan and not self.for_eval)
        settings = share_engines(settings, args, cores, leaders, n_workers)
        key = self.actor_key = warm_key(settings, needs, plan, folders, self.logs.folder,
                                        args.ray_address)
        # Actors a clean train() of this process parked (workers/driver/actors.py), if they fit.
        warm = take_warm(key) if self.started_ray and not self.for_eval else drop_warm()
        if warm is not None:
            use_folders(warm, folders)
        elif args.memory_check and self.started_ray:
            # This machine holds the whole run: refuse now what Ray would kill part-way.
            preflight(trainer, plan, [str(f) for f in folders], settings,
                      checkpointing=bool(self.checkpoint_dir))
        actors = warm or start_actors(trainer, self.logs, key, settings, needs, plan, folders,
                                      self.fingerprints["models"], self.for_eval,
                                      local=self.started_ray)
        self.pool, self.learners = actors.pool, actors.learners
        self.learner_specs, self.placement_group = actors.learner_specs, actors.placement_group
        self.checkpointer, self.transport = actors.checkpointer, actors.transport
        return plan, warm

    def _restore_learners(self, warm: Any) -> None:
        """A resume restores every learner (warm ones still holding the checkpoint keep
        their state, and their engines its weights); then every engine that does not hold
        the learners' weights gets them before the first rollout."""
        meta, kept = self.resume_meta, False
        if meta is not None:
            restored = ray_get([learner.resume.remote(str(Path(self.resume_path) / f"agent_{a}"),
                                                      meta["files"])
                                for a, learner in enumerate(self.learners)], "restoring learners")
            self.engine_versions = [version for version, _ in restored]
            kept = warm is not None and all(keeps for _, keeps in restored)
        # An engine serving several agents' adapters started with its own agent's alone.
        if (meta is not None or warm is not None or self.pool.shared) and not kept:
            self.push_weights()

    def _start_checkpointer(self, fresh: bool) -> None:
        # `_checkpoint_before_publish`: a test hook run in the checkpointer just before a
        # staged checkpoint is published (tests kill the run there).
        settings = (self.checkpoint_dir, self.total_limit, self.run_uid,
                    getattr(self.trainer, "_checkpoint_before_publish", None))
        if self.checkpointer is None:
            self.checkpointer = start_actor(
                Checkpointer, self.logs.place(Placement(), "checkpointer"), *settings)
        else:                                        # a warm one, for this run's folder
            ray_get(self.checkpointer.reset.remote(*settings), "checkpointer")
        ray_get(self.checkpointer.clean.remote(fresh_start=fresh), "checkpointer")
        self._warn_if_disk_is_short()

    def heal(self, failure: BaseException) -> None:
        """After an actor failure in the loop: if a learner or the checkpointer died, restart
        every learner and the checkpointer, restore the learners from this run's newest
        checkpoint (or the initial weights), push those to the engines and rewind the
        counters, so the loop redoes the lost work and logs the same values. Anything else,
        or more than `max_actor_restarts` times, is raised, naming the actor and the fix."""
        dead = [f"learner of agent {a}" for a, learner in enumerate(self.learners)
                if not is_alive(learner)]
        if self.checkpointer is not None and not is_alive(self.checkpointer):
            dead.append("checkpointer")
        if not dead or getattr(failure, "out_of_memory", False):
            raise failure                   # killed for memory: a restart would be too
        self.actor_restarts += 1
        newest = list_checkpoints(self.checkpoint_dir, self.run_uid) if self.checkpoint_dir \
            else []
        if self.actor_restarts > self.trainer.args.max_actor_restarts:
            resume = (f"resume with train(resume_from_checkpoint={str(newest[-1])!r}, ...)"
                      if newest else "start the run again")
            raise RuntimeError(
                f"{', '.join(dead)} died ({first_line(failure)}), and this run already "
                f"restarted its learners {self.trainer.args.max_actor_restarts} times "
                f"(max_actor_restarts); {resume}.") from failure
        self.pending_checkpoint = None       # the dead checkpointer's commit is lost
        kill_actors(self.learners + ([self.checkpointer] if self.checkpointer else []))
        self.checkpointer = None            # a new one is started below
        self.learners = [start_actor(*spec, **kw) for spec, kw in self.learner_specs]
        self.pool.rehost(self.learners)             # `colocate`: the hosts are workers 0
        if self.checkpoint_dir:
            self._start_checkpointer(fresh=False)   # its clean-up may restore a checkpoint
            newest = list_checkpoints(self.checkpoint_dir, self.run_uid)
        for a, learner in enumerate(self.learners):
            self.transport.connect(a, learner, self.workers[a])
        self.pool.attach(self.learners, self.transport)
        meta = read_checkpoint_metadata(newest[-1]) if newest else {}
        if newest:
            ray_get([learner.load.remote(str(newest[-1] / f"agent_{a}"))
                     for a, learner in enumerate(self.learners)], "restoring learners")
        self._restore_progress(meta)
        self.push_weights()
        self.pending_metrics["actors/restarts"] = self.actor_restarts
        warnings.warn(f"{', '.join(dead)} died ({first_line(failure)}); restarted the "
                      f"learners and checkpointer from "
                      f"{newest[-1].name if newest else 'the initial weights'} (env_step "
                      f"{self.trainer.env_step}), redoing the work since (restart "
                      f"{self.actor_restarts} of at most {self.trainer.args.max_actor_restarts}).")

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """Stop everything, each step whatever the others did. W&B is told the truth: a run
        that failed or was stopped finishes with a nonzero exit code."""
        if exc_type is None:
            exit_code = 0
        elif issubclass(exc_type, SystemExit):
            exit_code = exc.code if isinstance(exc.code, int) and exc.code else 1
        else:
            exit_code = 1
        def release_actors() -> None:
            # A clean train() on a Ray this process started parks its actors for the next
            # train() (workers/driver/actors.py); anything else kills them.
            if exit_code == 0 and first_error is None and self.started_ray \
                    and not self.for_eval and self.pool is not None:
                park(Actors(self.actor_key, self.pool, self.learners, self.learner_specs,
                            self.checkpointer, self.placement_group, self.transport,
                            self.fingerprints["models"]))
            else:
                kill_actors(self.actors)
                remove_placement(self.placement_group)

        def finish_wandb() -> None:
            if self.wandb is None and self.opening_wandb is not None:
                self.wandb = self.opening_wandb.result()    # a start that failed meanwhile
            if self.wandb is not None:
                self.wandb.finish(exit_code)

        def remove_model_folders() -> None:
            if self.tmp is not None:
                wait([self.saving])         # nothing may still write into them
                self.tmp.cleanup()

        # The models' folders go last, once nothing writes into them (`save_models`).
        steps = [self.wait_checkpoint, finish_wandb, release_actors, remove_model_folders]
        first_error = None
        for step in steps:
            try:
                step()
            except BaseException as error:  # noqa: BLE001 - the rest must still run
                first_error = first_error or error
        self.pool, self.learners, self.checkpointer = None, [], None
        if self.logs is not None and not self.for_eval and exc_type is None:
            console.summary(self.written, self.wandb_info, self.logs, self.checkpoint_dir)
        if first_error is not None and exc_type is None:
            raise first_error

    # ---- generation (comlrl.rollout calls this)

    def generate(self, requests_per_agent: list[list[dict]], record: StepRecord) -> list[list]:
        """Every agent's requests in one round of engine calls (`RolloutPool.generate`)."""
        result = self.pool.generate(requests_per_agent)
        record.generation += result["seconds"]
        record.tokens += result["tokens"]
        record.policy_versions.update(result["policy_versions"])
        return result["outputs"]

    # ---- learning and weight push

    def update_and_push(self, nodes: list[Node], record: StepRecord) -> None:
        """One update of every learner on `nodes` (comlrl's drained buffer), then the push."""
        args = self.trainer.args
        # Engines release their GPU memory before the learners train (single_gpu preset).
        self.sleep_engines()
        refs = []
        for a, learner in enumerate(self.learners):
            groups = [learner_group(node, a, args) for node in nodes]
            seed = magrpo.derive_seed(args.seed, "shuffle", self.progress.learner_updates, a)
            refs.append(learner.update.remote(groups, seed))
        start = time.perf_counter()
        record.learner = ray_get(refs, "learners updating")
        record.learning = time.perf_counter() - start
        self.progress.learner_updates += 1
        start = time.perf_counter()
        self.push_weights()
        record.weight_sync = time.perf_counter() - start

    def push_weights(self) -> None:
        """Every learner's current weights to each of its agent's engines (`workers/transports/`);
        a worker found dead is restarted, which gives it these same weights."""
        if self.trainer.args.enable_sleep_mode:      # engines wake (`sleep_engines`)
            self.pool.call_every_worker("wake")
        versions = ray_get([l.get_version.remote() for l in self.learners], "learners")
        self.pool.push(versions)
        self.engine_versions = list(versions)

    def sleep_engines(self) -> None:
        """Put every engine to sleep before the learners train (vLLM sleep mode releases its
        GPU memory; needed when learner and engines share a GPU, e.g. single_gpu). No-op
        unless `enable_sleep_mode`. Engines wake in `push_weights` or on their next call."""
        if self.trainer.args.enable_sleep_mode:
            self.pool.call_every_worker("sleep")

    def _on_worker_restart(self, message: str) -> None:
        self.pending_metrics["rollout/restarts"] = self.pool.restarts
        warnings.warn(message)

    # ---- logging

    def log(self, metrics: dict, step: int) -> None:
        # Events such as rollout/restarts ride along with the next point that is sent.
        metrics = {**metrics, **self.pending_metrics}
        if metrics and self.wandb is not None and self.wandb.log(metrics, step):
            self.pending_metrics = {}

    def log_step(self, nodes: list[Node], record: StepRecord, extra: dict, step: int) -> None:
        """An update's training metrics at env_step `step` (every `logging_steps`) plus `extra`."""
        logging_steps = self.trainer.args.logging_steps
        last = self.progress.last_train_log
        if last >= 0 and step - last < logging_steps:
            self.log(extra, step)
            return
        self.progress.last_train_log = step
        self.log({**extra, **step_metrics(nodes, record, self.trainer.args,
                                          self.progress.epoch)}, step)

    # ---- checkpoints

    def save_checkpoint(self) -> None:
        """Learners snapshot their state and write it into a staging dir in the background;
        the checkpointer publishes it once every write is done. Training goes on meanwhile."""
        self.wait_checkpoint()
        self._warn_if_disk_is_short()
        staging = ray_get(self.checkpointer.begin.remote(self.progress.epoch), "checkpointer")
        ray_get([learner.save.remote(str(Path(staging) / f"agent_{a}"))
                 for a, learner in enumerate(self.learners)], "learners saving")
        metadata = {
            **self.progress.to_metadata(self.trainer.env_step),
            "last_logged_step": self.wandb.last_step,
            "wandb_rows": self.wandb.rows,   # durable with the checkpoint (wandb_run.py)
            "policy_versions": list(self.engine_versions),
            "wandb": self.wandb.identity or {}, "run_uid": self.run_uid,
            "fingerprints": self.fingerprints, "created": time.time(),
        }
        # Ray runs the commit once every learner's `saved` (the files it wrote) is ready.
        writes = [learner.saved.remote() for learner in self.learners]
        epoch = self.progress.epoch
        self.pending_checkpoint = (epoch, writes,
                                   self.checkpointer.commit.remote(epoch, metadata, *writes))

    def _restore_progress(self, meta: dict) -> None:
        """Set the counters from checkpoint metadata ({}: a fresh start). The only place
        besides the rollout (which counts it up) that writes the trainer's env_step."""
        self.progress, self.trainer.env_step = Progress.from_metadata(meta)

    def _warn_if_disk_is_short(self) -> None:
        text = ray_get(self.checkpointer.free_space_warning.remote(), "checkpointer")
        if text:
            warnings.warn(text)

    def wait_checkpoint(self) -> str | None:
        import ray

        if self.pending_checkpoint is None:
            return None
        (epoch, writes, ref), self.pending_checkpoint = self.pending_checkpoint, None
        try:
            path = ray_get(ref, "checkpointer writing")
        except (ActorFailure, CheckpointWriteError):
            raise                           # a dead actor (`heal`), or already explained
        except Exception as exc:  # noqa: BLE001 - a learner's write: SafetensorError, OSError
            # e.g. a full disk: once every learner's write has ended, the checkpointer removes
            # the staging folder and raises an error naming checkpoint_dir and the bytes
            # needed; earlier checkpoints stay.
            ray.wait(writes, num_returns=len(writes))
            ray_get(self.checkpointer.abort.remote(epoch, f"{type(exc).__name__}: {exc}"),
                    "checkpointer")
            raise
        self.written.append(path)
        return path

    def pull_weights(self) -> None:
        """The learners' final weights into the trainer's agents (for save_model). Where this
        run's last checkpoint holds exactly them (written after the last update, and this
        process sees its folder), each agent's weights are mapped from its safetensors file
        instead, as `from_pretrained` maps a model: memory the kernel can reclaim, not a new
        copy per agent (at 358M that copy was the run's peak, BENCHMARKS.md section 7)."""
        models = self.trainer._initial_models()
        last = Path(self.written[-1]) if self.written else None
        left = list(zip(self.learners, models))
        if last is not None and last.name == f"checkpoint-{self.progress.epoch}" and last.is_dir():
            files = read_checkpoint_metadata(last).get("files", {})
            holds = ray_get([learner.holds.remote(f"agent_{a}", files)
                             for a, learner in enumerate(self.learners)], "learners")
            left = [(learner, model) for a, (learner, model, same) in
                    enumerate(zip(self.learners, models, holds))
                    if not (same and map_checkpoint_weights(model, last / f"agent_{a}"))]
        if left:
            pull_weights([learner for learner, _ in left], [model for _, model in left])
