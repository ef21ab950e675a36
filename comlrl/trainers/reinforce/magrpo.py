"""MAGRPOTrainer: the driver. It owns the loop and the only W&B run; Ray actors do the work.

    rollout (engines) -> reward -> advantages -> update (learners) -> push weights -> log
    -> checkpoint (checkpointer)

`_Session` holds everything a `train()` call starts (Ray, actors, W&B) and stops it all.
"""

from __future__ import annotations

import math
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from comlrl import magrpo
from comlrl.checkpoint import (
    CheckpointError, compare_fingerprints, fingerprint_callable, fingerprint_model_folder,
    fingerprint_rows, fingerprint_tokenizer, list_checkpoints, read_checkpoint_metadata,
    read_journal, verify_checksums,
)
from comlrl.config import RESUMABLE_FIELDS, MAGRPOConfig
from comlrl.rollout import Episode, StepRecord, run_episode_batch


class MAGRPOTrainer:
    """Multi-agent GRPO with vLLM rollout workers and per-agent learners on Ray.

    Arguments follow comlrl 1.4.3: `agents=[HF models]` or `agent_model="name-or-path"` with
    `num_agents`, `tokenizer` (one, or one per agent), `reward_func(completions_agent0, ...)`,
    `train_dataset` with a `prompt` column, `args=MAGRPOConfig(...)`, `wandb_config` (None: no
    W&B). Constructing it validates everything and starts nothing heavy.
    """

    default_config_cls = MAGRPOConfig
    algorithm_name = "MAGRPO"

    def __init__(self, agent_model: str | Any | None = None, agents: Sequence[Any] | None = None,
                 num_agents: int = 2, tokenizer: Any = None, model_config: dict | None = None,
                 train_dataset: Any = None, eval_dataset: Any = None,
                 reward_func: Callable | None = None,
                 reward_processor: Callable[[float], float] | None = None,
                 formatters: Callable | Sequence[Callable] | None = None,
                 external_transition: Callable | None = None, wandb_config: dict | None = None,
                 eval_logger: Callable | None = None, eval_aggregator: Callable | None = None,
                 args: MAGRPOConfig | None = None):
        self.args = args if args is not None else self.default_config_cls()
        if not isinstance(self.args, MAGRPOConfig):
            raise ValueError(f"args must be a MAGRPOConfig (got {type(self.args).__name__}).")
        if agent_model is None and agents is None:
            raise ValueError("Either agent_model or agents must be provided.")
        if agents is None and not isinstance(agent_model, str):
            raise ValueError("agent_model should be a string to create homogeneous agents")
        self.agents = list(agents) if agents is not None else None
        self.agent_model = agent_model
        self.num_agents = len(self.agents) if self.agents is not None else int(num_agents)
        if self.agents is not None and agent_model is None:
            self.args.num_agents = self.num_agents
        if self.num_agents < 1:
            raise ValueError("num_agents must be >= 1.")
        self.model_config = dict(model_config or {})
        self.tokenizers = self._resolve_tokenizers(tokenizer)
        self.tokenizer = self.tokenizers[0]
        if reward_func is None or not callable(reward_func):
            raise ValueError("reward_func must be a callable.")
        self.reward_func = reward_func
        self.reward_style = magrpo.reward_call_style(reward_func, self.num_agents)
        self.reward_processor = reward_processor
        self.formatters = _build_formatters(formatters, self.num_agents)
        if self.args.num_turns > 1 and external_transition is None:
            raise ValueError("Multi-turn MAGRPO requires an external_transition.")
        self.external_transition = external_transition
        self.train_rows = _dataset_rows(train_dataset, "train_dataset")
        if self.train_rows is None:
            raise ValueError("train_dataset is required: a datasets.Dataset with a 'prompt' "
                             "column (or formatters that build prompts from its rows).")
        self.eval_rows = _dataset_rows(eval_dataset, "eval_dataset")
        self.wandb_config = wandb_config
        self.eval_logger = eval_logger
        self.eval_aggregator = eval_aggregator
        self.env_step = 0
        self._session: _Session | None = None

    # ------------------------------------------------------------------ public API

    def train(self, checkpoint_dir: str | None = None, checkpoint_interval: int = 1,
              resume_from_checkpoint: str | None = None,
              checkpoint_total_limit: int | None = None) -> None:
        """Train to `num_train_epochs` (the whole run's total), checkpointing every
        `checkpoint_interval` epochs and after the last one into `checkpoint_dir/checkpoint-N`."""
        if not isinstance(checkpoint_interval, int) or checkpoint_interval < 1:
            raise ValueError("checkpoint_interval must be a positive integer.")
        if checkpoint_total_limit is not None and checkpoint_total_limit < 1:
            raise ValueError("checkpoint_total_limit must be None or >= 1.")
        resume_meta = self._check_resume(checkpoint_dir, resume_from_checkpoint)
        with _Session(self, checkpoint_dir, checkpoint_total_limit, resume_from_checkpoint,
                      resume_meta) as session:
            self._session = session
            try:
                self._train_loop(session, checkpoint_dir, checkpoint_interval)
            finally:
                self._session = None

    def _train_loop(self, s: "_Session", checkpoint_dir: str | None, interval: int) -> None:
        args, rows = self.args, self.train_rows
        total_epochs, chunk = args.num_train_epochs, args.rollout_buffer_size
        bar = s.progress_bar(total=(total_epochs - s.epoch) * len(rows))
        if self.env_step == 0 and self._eval_due(0):
            s.log(self._evaluate_now(s), 0)
        for epoch in range(s.epoch, total_epochs):
            for start in range(0, len(rows), chunk):
                batch = list(range(start, min(start + chunk, len(rows))))
                record = StepRecord()
                episodes = run_episode_batch(self, s, epoch, batch, record)
                # Evaluations due inside this chunk see the same (pre-update) weights as their
                # prompt would; each logs at the env_step its prompt started at.
                for ep in episodes[1:]:
                    if self._eval_due(ep.row_index):
                        s.log(self._evaluate_now(s), ep.env_step_before)
                s.update_and_push(episodes, record)
                # The evaluation before the next chunk's first prompt runs now, with the new
                # weights, and shares this step's log line (the same env_step).
                upcoming = start + chunk if start + chunk < len(rows) else 0
                extra = self._evaluate_now(s) if self._eval_due(upcoming) else {}
                s.log_step(episodes, record, extra)
                bar.update(len(batch))
                bar.set_postfix(env_step=self.env_step,
                                reward=f"{episodes[0].turn_means()[0][0]:.3f}",
                                tok_s=f"{record.tokens / max(record.generation, 1e-9):.0f}")
            s.epoch = epoch + 1
            if checkpoint_dir and (s.epoch % interval == 0 or s.epoch == total_epochs):
                s.save_checkpoint()
        bar.close()
        s.wait_checkpoint()
        s.pull_weights()

    def _eval_due(self, prompt_index: int) -> bool:
        interval = self.args.eval_interval
        return bool(self.eval_rows) and interval > 0 and prompt_index % interval == 0 \
            and self.args.eval_num_samples > 0

    def _evaluate_now(self, s: "_Session") -> dict[str, float]:
        from comlrl.evaluation import run_evaluation

        return run_evaluation(self, s, self.args.eval_num_samples)

    def evaluate(self, num_eval_samples: int | None = None) -> dict[str, float]:
        """Evaluate on `eval_dataset` and log under `eval/` at the current env_step."""
        from comlrl.evaluation import run_evaluation

        if self._session is not None:
            metrics = run_evaluation(self, self._session, num_eval_samples)
            self._session.log(metrics, self.env_step)
            return metrics
        with _Session(self, None, None, None, None, for_eval=True) as session:
            metrics = run_evaluation(self, session, num_eval_samples)
            session.log(metrics, self.env_step)
            return metrics

    def save_model(self, output_dir: str) -> list[str]:
        """Write one `from_pretrained` folder per agent: output_dir/agent_0, agent_1, ...

        After `train()` the agents hold the trained weights."""
        out = Path(output_dir)
        paths = []
        for i, model in enumerate(self._initial_models()):
            model.save_pretrained(out / f"agent_{i}", safe_serialization=True)
            self.tokenizers[i].save_pretrained(out / f"agent_{i}")
            paths.append(str(out / f"agent_{i}"))
        return paths


    # ------------------------------------------------------------------ validation

    def _resolve_tokenizers(self, tokenizer: Any) -> list:
        if tokenizer is None:
            if isinstance(self.agent_model, str):
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.agent_model)
            else:
                raise ValueError("tokenizer is required: pass the agents' tokenizer "
                                 "(AutoTokenizer.from_pretrained(model_name)).")
        toks = list(tokenizer) if isinstance(tokenizer, (list, tuple)) else [tokenizer] * self.num_agents
        if len(toks) != self.num_agents:
            raise ValueError(f"tokenizer: got {len(toks)} tokenizers for {self.num_agents} agents; "
                             f"pass one tokenizer or one per agent.")
        for i, tok in enumerate(toks):
            for k, v in self.model_config.get("special_tokens", {}).items():
                setattr(tok, k, v)
            if tok.eos_token_id is None:
                raise ValueError(f"tokenizer {i} has no eos_token: set tokenizer.eos_token (e.g. "
                                 f"'<|endoftext|>'); completions must be able to end.")
            if tok.pad_token_id is None:
                raise ValueError(f"tokenizer {i} has no pad_token: set tokenizer.pad_token = "
                                 f"tokenizer.eos_token before building the trainer.")
        return toks

    def _initial_models(self) -> list:
        if self.agents is not None:
            return self.agents
        from transformers import AutoModelForCausalLM

        kwargs = {k: v for k, v in self.model_config.items() if k != "special_tokens"}
        if isinstance(kwargs.get("dtype"), str) and kwargs["dtype"] != "auto":
            import torch

            kwargs["dtype"] = getattr(torch, kwargs["dtype"])
        self.agents = [AutoModelForCausalLM.from_pretrained(self.agent_model, **kwargs)
                       for _ in range(self.num_agents)]
        return self.agents

    def _check_resume(self, checkpoint_dir: str | None, resume: str | None) -> dict | None:
        """Refuse a foreign checkpoint_dir; read and verify the checkpoint to resume from."""
        meta = None
        if resume is not None:
            meta = read_checkpoint_metadata(resume)
            verify_checksums(resume, meta)
        if checkpoint_dir:
            existing = list_checkpoints(checkpoint_dir)
            if existing and meta is None:
                raise CheckpointError(
                    f"checkpoint_dir {checkpoint_dir} already holds checkpoints of another run "
                    f"({', '.join(p.name for p in existing[-3:])}). Pass "
                    f"resume_from_checkpoint=<one of them> to continue that run, or use an "
                    f"empty checkpoint_dir.")
            for p in existing:
                try:
                    other = read_checkpoint_metadata(p)
                except CheckpointError:
                    continue
                if other.get("run_uid") != meta.get("run_uid"):
                    raise CheckpointError(
                        f"checkpoint_dir {checkpoint_dir} holds {p.name} of another run (run "
                        f"{other.get('run_uid')}, resuming {meta.get('run_uid')}); pick the "
                        f"checkpoint_dir of the run you resume, or an empty one.")
        return meta

    def fingerprints(self, model_folders: list[str]) -> dict:
        """What must not change between a checkpoint and its resume."""
        cfg = {k: v for k, v in self.args.to_dict().items() if k not in RESUMABLE_FIELDS}
        return {
            "config": cfg,
            "num_agents": self.num_agents,
            "dataset": fingerprint_rows(self.train_rows),
            "eval_dataset": fingerprint_rows(self.eval_rows),
            "reward_func": fingerprint_callable(self.reward_func),
            "reward_processor": fingerprint_callable(self.reward_processor),
            "external_transition": fingerprint_callable(self.external_transition),
            "formatters": [fingerprint_callable(getattr(f, "user", None)) for f in self.formatters],
            "models": [fingerprint_model_folder(f) for f in model_folders],
            "tokenizers": [fingerprint_tokenizer(t) for t in self.tokenizers],
        }


# ---------------------------------------------------------------------- helpers


def _dataset_rows(dataset: Any, name: str) -> list[dict] | None:
    if dataset is None:
        return None
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise ValueError(f"{name} must be a map-style datasets.Dataset (or a list of dicts); "
                         f"got {type(dataset).__name__}. Materialise an IterableDataset first.")
    rows = [dict(dataset[i]) for i in range(len(dataset))]
    if not rows:
        raise ValueError(f"{name} is empty; it needs at least one row with a 'prompt'.")
    if "prompt" not in rows[0]:
        raise ValueError(f"{name} has no 'prompt' column (columns: {sorted(rows[0])}); add one, "
                         f"e.g. dataset.rename_column('text', 'prompt').")
    return rows


def _build_formatters(formatters: Any, num_agents: int) -> list[Callable]:
    """One formatter per agent, each callable as f(row, external_prompts=None) -> str."""
    import inspect

    def default(row: dict, external_prompts: Any = None) -> str:
        return external_prompts if external_prompts is not None else row.get("prompt", "")

    def wrap(fmt: Callable) -> Callable:
        try:
            takes_external = "external_prompts" in inspect.signature(fmt).parameters
        except (TypeError, ValueError):
            takes_external = False

        def call(row: dict, external_prompts: Any = None) -> str:
            if takes_external:
                return fmt(row, external_prompts=external_prompts)
            return fmt(row)

        call.user = fmt
        return call

    if formatters is None:
        return [default] * num_agents
    if callable(formatters):
        return [wrap(formatters)] * num_agents
    if isinstance(formatters, (list, tuple)):
        if len(formatters) != num_agents:
            raise ValueError("Number of formatters must match num_agents when providing a sequence.")
        return [wrap(f) for f in formatters]
    raise ValueError("formatters must be None, a callable, or a sequence of callables.")


# ---------------------------------------------------------------------- the session


class _Session:
    """Everything one `train()` call runs on: Ray, actors, the W&B run and the counters."""

    def __init__(self, trainer: MAGRPOTrainer, checkpoint_dir: str | None,
                 total_limit: int | None, resume_path: str | None, resume_meta: dict | None,
                 for_eval: bool = False):
        self.t = trainer
        self.checkpoint_dir = checkpoint_dir
        self.total_limit = total_limit
        self.resume_path = resume_path
        self.resume_meta = resume_meta
        self.for_eval = for_eval
        self.epoch = 0
        self.update_index = 0
        self.versions = [0] * trainer.num_agents
        self.actors: list = []
        self.wandb = None
        self.pending_checkpoint = None
        self.run_uid = None
        self.pending_metrics: dict = {}

    # ---- start / stop

    def __enter__(self) -> "_Session":
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self) -> None:
        import ray

        from comlrl.wandb_run import WandbRun
        from workers.checkpointer import Checkpointer
        from workers.launch import (
            Placement, check_resources, ensure_ray, pack_model_folder, place, plan_placement,
            ray_get, start_actor,
        )
        from workers.transport import with_learner_endpoint
        from workers.learner import Learner
        from workers.rollout import RolloutWorker

        t, args = self.t, self.t.args
        self.tmp = tempfile.TemporaryDirectory(prefix="comlrl-split-")
        folders = []
        for i, (model, tok) in enumerate(zip(t._initial_models(), t.tokenizers)):
            folder = Path(self.tmp.name) / f"agent_{i}"
            model.save_pretrained(folder, safe_serialization=True)
            tok.save_pretrained(folder)
            folders.append(str(folder))
        self.fingerprints = t.fingerprints(folders)
        meta = self.resume_meta
        if meta is not None:
            compare_fingerprints(meta["fingerprints"], self.fingerprints, RESUMABLE_FIELDS)
            t.env_step = int(meta["env_step"])
            self.epoch = int(meta["epoch"])
            self.update_index = int(meta["update_index"])
            self.last_train_log = int(meta.get("last_train_log", -1))
            self.run_uid = meta["run_uid"]
        else:
            t.env_step = 0
            self.run_uid = f"{time.time_ns():x}"
        if self.epoch > args.num_train_epochs:
            raise ValueError(f"num_train_epochs={args.num_train_epochs} is below the "
                             f"{self.epoch} epochs the checkpoint already completed; "
                             f"num_train_epochs counts the whole run.")

        weight_bytes = sum(p.numel() * p.element_size() for m in t._initial_models()
                           for p in m.state_dict().values())
        self.started_ray = ensure_ray(args.ray_address, weight_bytes)
        cores = max(1, int(ray.cluster_resources().get("CPU", 1)))
        n_workers = t.num_agents * args.rollout_workers_per_agent
        # One placement-group bundle per actor (workers.launch.plan_placement says why PACK,
        # or STRICT_PACK for single_gpu); impossible requests fail here, naming the setting.
        plan = plan_placement(args, t.num_agents)
        needs = [("rollout", plan["rollout"])] * n_workers
        if not self.for_eval:
            needs += [("learner", plan["learner"])] * t.num_agents
        check_resources(needs, plan["strategy"])
        placed, self.placement_group = place(needs, plan["strategy"], args.placement_timeout_s)
        sources = [ray.put(pack_model_folder(f)) for f in folders]
        sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        top_p=args.top_p, top_k=args.top_k)
        engine_kwargs = dict(
            dtype=args.engine_dtype, enforce_eager=args.enforce_eager,
            max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            gpu_memory_utilization=plan["gpu_memory_utilization"],
            tensor_parallel_size=args.tensor_parallel_size,
            enable_sleep_mode=args.enable_sleep_mode, seed=args.seed,
            threads=args.rollout_threads or max(1, cores // n_workers))
        self.workers, self.worker_specs = [], {}
        per_agent = args.rollout_workers_per_agent
        for a in range(t.num_agents):
            stop = (t.tokenizers[a].eos_token_id,)
            for i in range(per_agent):
                # Kept to restart a worker that dies with the same arguments and bundle.
                self.worker_specs[a, i] = (RolloutWorker, placed[a * per_agent + i], a,
                                           sources[a], args.rollout_engine,
                                           {**sampling, "stop_token_ids": stop}, engine_kwargs)
            self.workers.append([start_actor(*self.worker_specs[a, i])
                                 for i in range(per_agent)])
        self.learners = [] if self.for_eval else [
            start_actor(with_learner_endpoint(Learner), placed[n_workers + a], a, sources[a],
                        learning_rate=args.agent_learning_rate,
                        train_batch_size=args.train_batch_size,
                        loss_aggregation=args.loss_aggregation,
                        advantage_mode=args.advantage_mode,
                        advantage_normalization=args.advantage_normalization,
                        reference_kl_coef=(args.reference_kl_coef
                                           if args.reference_kl_enabled else None),
                        device=args.learner_device,
                        threads=args.learner_threads or max(1, cores // t.num_agents))
            for a in range(t.num_agents)]
        self.actors = [w for ws in self.workers for w in ws] + self.learners
        self.checkpointer = None
        if self.checkpoint_dir and not self.for_eval:
            self.checkpointer = start_actor(Checkpointer, Placement(), self.checkpoint_dir,
                                            self.total_limit)
            self.actors.append(self.checkpointer)
            ray_get(self.checkpointer.clean.remote(), "checkpointer")
        ray_get([w.get_version.remote() for w in self.actors if w is not self.checkpointer],
                "starting rollout workers and learners")
        self.transport = self._connect_transport(plan)
        if meta is not None:
            # Restore learners, then give every engine the restored weights before any rollout.
            self.versions = ray_get(
                [l.load.remote(str(Path(self.resume_path) / f"agent_{a}"))
                 for a, l in enumerate(self.learners)], "restoring learners")
            self.push_weights()
        last_logged = -1
        if meta is not None:
            last_logged = self._last_logged_step(meta)
        run_config = {"algorithm": t.algorithm_name, "num_agents": t.num_agents,
                      **{k: v for k, v in args.to_dict().items() if k != "extra"}}
        self.wandb = WandbRun(t.wandb_config, run_config, self.checkpoint_dir, last_logged)
        self.wandb.start()

    def _last_logged_step(self, meta: dict) -> int:
        """Steps at or below this were sent to W&B before; the resumed run skips them.

        The run's own files are the truth where this machine can read them; otherwise the
        journal (rewritten after each log) or the checkpoint says how far the last process got.
        """
        from comlrl.wandb_run import last_step_on_disk

        cfg = self.t.wandb_config or {}
        run_id = cfg.get("id") or meta.get("wandb", {}).get("id")
        on_disk = last_step_on_disk(run_id, cfg) if run_id and cfg else None
        if on_disk is not None:
            return on_disk
        journal = read_journal(self.checkpoint_dir, run_id) if self.checkpoint_dir else -1
        return max(int(meta.get("last_logged_step", -1)), journal)

    def __exit__(self, *exc: Any) -> None:
        from workers.launch import kill_actors, remove_placement

        try:
            self.wait_checkpoint()
        finally:
            if self.wandb is not None:
                self.wandb.finish()
            kill_actors(self.actors)
            self.actors = []
            remove_placement(getattr(self, "placement_group", None))
            if getattr(self, "tmp", None) is not None:
                self.tmp.cleanup()

    def progress_bar(self, total: int):
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="MAGRPO", unit="prompt", disable=not self.t.args.verbose,
                    dynamic_ncols=True)

    # ---- generation (used by comlrl.rollout)

    def generate(self, requests_per_agent: list[list[dict]], record: StepRecord) -> list[list]:
        """Every agent's requests in one round: split across that agent's workers, all at once.

        A worker that dies meanwhile is restarted with the current weights and given its part
        again; the part's requests carry their seeds, so the redone samples are the same.
        """
        from workers.launch import ActorFailure, ray_get

        parts = []
        for a, reqs in enumerate(requests_per_agent):
            n_workers = len(self.workers[a])
            size = math.ceil(len(reqs) / n_workers) if reqs else 0
            for w_i in range(n_workers):
                part = reqs[w_i * size:(w_i + 1) * size]
                if part:
                    parts.append((a, w_i, part))
        start = time.perf_counter()
        refs = [self.workers[a][w_i].generate.remote(part) for a, w_i, part in parts]
        results = []
        for (a, w_i, part), ref in zip(parts, refs):
            for attempt in range(self.MAX_RESTARTS_PER_CALL + 1):
                try:
                    results.append(ray_get(ref, f"rollout worker {w_i} of agent {a} generating"))
                    break
                except ActorFailure as exc:
                    if attempt == self.MAX_RESTARTS_PER_CALL:
                        raise
                    self._restart_worker(a, w_i, exc)
                    ref = self.workers[a][w_i].generate.remote(part)
        record.generation += time.perf_counter() - start
        outputs: list[list] = [[] for _ in requests_per_agent]
        for (a, _, _), res in zip(parts, results):
            outputs[a].extend(res["outputs"])
            record.tokens += res["tokens"]
            record.rollout_versions[a] = res["version"]
        return outputs

    # ---- learning and weight push

    def update_and_push(self, episodes: list[Episode], record: StepRecord) -> None:
        from workers.launch import ray_get

        t, args = self.t, self.t.args
        # Engines release their GPU memory before the learners train (single_gpu preset).
        self.sleep_engines()
        refs = []
        for a, learner in enumerate(self.learners):
            groups = [g for ep in episodes for g in ep.learner_groups(a, args)]
            seed = magrpo.derive_seed(args.seed, "shuffle", self.update_index, a)
            refs.append(learner.update.remote(groups, seed))
        start = time.perf_counter()
        record.learner = ray_get(refs, "learners updating")
        record.learning = time.perf_counter() - start
        self.update_index += 1
        start = time.perf_counter()
        self.push_weights()
        record.weight_sync = time.perf_counter() - start

    def push_weights(self) -> None:
        """Every learner's current weights to each of its agent's engines, through the
        session's weight transport (`workers.transport`). A worker found dead is restarted,
        which gives it these same weights."""
        import ray

        from workers.launch import ActorFailure, ray_get

        self.wake_engines()
        versions = ray_get([l.get_version.remote() for l in self.learners], "learners")
        refs = {a: self.transport.push(a, l, self.workers[a], versions[a])
                for a, l in enumerate(self.learners)}
        errors = {}
        for a, agent_refs in refs.items():
            for ref in agent_refs:
                try:
                    ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - sorted out below
                    errors.setdefault(a, exc)
        for a, exc in errors.items():
            dead = self._dead_workers(a)
            if not dead:  # a real error in the learner or engine, not a lost worker
                if isinstance(exc, ray.exceptions.RayActorError):
                    raise ActorFailure(f"pushing weights of agent {a}: the Ray actor died: "
                                       f"{exc}") from exc
                raise exc
            for w_i in dead:
                self._restart_worker(a, w_i, exc)
        self.versions = list(versions)

    # ---- scale-out: transports, restarts, sleep mode

    MAX_RESTARTS_PER_CALL = 2
    """A worker that dies again this often within one generate call is not restarted again."""

    def _connect_transport(self, plan: dict):
        """The weight transport `plan` chose, connected to every learner and its workers.

        With weight_transport='auto', a GPU transport that cannot be set up falls back to the
        object store with a warning; an explicit choice fails instead."""
        import warnings

        from workers.transport import ObjectStoreTransport, make_transport

        args = self.t.args
        gpus = plan["learner"].num_gpus > 0 and plan["rollout"].num_gpus > 0
        bucket = int(os.environ.get("COMLRL_WEIGHT_BUCKET_BYTES", 256 * 1024 * 1024))
        transport = make_transport(plan["transport"], backend="nccl" if gpus else "gloo",
                                   bucket_bytes=bucket)
        try:
            for a, learner in enumerate(self.learners):
                transport.connect(a, learner, self.workers[a])
        except Exception as exc:
            if args.weight_transport != "auto":
                raise
            warnings.warn(f"weight_transport='auto' chose {transport.name!r}, which could not "
                          f"be set up ({exc}); pushing weights through the Ray object store.")
            transport = ObjectStoreTransport()
        return transport

    def _dead_workers(self, agent: int) -> list[int]:
        import ray

        dead = []
        for w_i, w in enumerate(self.workers[agent]):
            try:
                ray.get(w.get_version.remote(), timeout=60)
            except ray.exceptions.RayActorError:
                dead.append(w_i)
        return dead

    def _restart_worker(self, agent: int, index: int, cause: BaseException) -> None:
        """Replace dead worker `index` of `agent` by a new one with the same arguments and
        bundle, holding the learner's current weights, before it generates again."""
        import warnings

        from workers.launch import kill_actors, ray_get, start_actor

        old = self.workers[agent][index]
        kill_actors([old])
        new = start_actor(*self.worker_specs[agent, index])
        self.workers[agent][index] = new
        self.actors = [new if a is old else a for a in self.actors]
        ray_get(new.get_version.remote(), f"restarting rollout worker {index} of agent {agent}")
        if self.learners:
            learner = self.learners[agent]
            version = ray_get(learner.get_version.remote(), f"learner {agent}")
            ray_get(self.transport.refresh(agent, learner, self.workers[agent], index, version),
                    f"pushing weights to restarted rollout worker {index} of agent {agent}")
        self.rollout_restarts += 1
        self.pending_metrics["rollout/restarts"] = self.rollout_restarts
        why = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:300]
        warnings.warn(f"rollout worker {index} of agent {agent} died ({why}); restarted it "
                      f"with the current weights (restart {self.rollout_restarts} of this run).")

    rollout_restarts = 0

    def sleep_engines(self) -> None:
        """Put every engine to sleep before the learners train (vLLM sleep mode releases its
        GPU memory; needed when learner and engines share a GPU, e.g. single_gpu). No-op
        unless `enable_sleep_mode`. Engines wake in `push_weights` or on their next call."""
        if self.t.args.enable_sleep_mode:
            self._on_every_worker("sleep")

    def wake_engines(self) -> None:
        """Wake every engine (no-op unless `enable_sleep_mode`)."""
        if self.t.args.enable_sleep_mode:
            self._on_every_worker("wake")

    def _on_every_worker(self, method: str) -> None:
        """Call `method` on every rollout worker at once; a dead one is restarted first."""
        from workers.launch import ActorFailure, ray_get

        calls = [(a, i, getattr(w, method).remote())
                 for a, ws in enumerate(self.workers) for i, w in enumerate(ws)]
        for a, i, ref in calls:
            what = f"rollout worker {i} of agent {a}: {method}"
            try:
                ray_get(ref, what)
            except ActorFailure as exc:
                self._restart_worker(a, i, exc)
                ray_get(getattr(self.workers[a][i], method).remote(), what)

    # ---- logging

    def log(self, metrics: dict, step: int) -> None:
        # Events such as rollout/restarts ride along with the next point that is sent.
        metrics = {**metrics, **self.pending_metrics}
        if metrics and self.wandb is not None and self.wandb.log(metrics, step):
            self.pending_metrics = {}

    def log_step(self, episodes: list[Episode], record: StepRecord, extra: dict) -> None:
        """The step's training metrics (every `logging_steps` env_steps) plus `extra`."""
        t, args = self.t, self.t.args
        step = t.env_step
        if self.last_train_log >= 0 and step - self.last_train_log < args.logging_steps:
            self.log(extra, step)
            return
        self.last_train_log = step
        metrics: dict[str, float] = dict(extra)
        for turn, (reward_mean, expected_return, n) in enumerate(_turn_stats(episodes)):
            if n:
                metrics[f"turn_{turn + 1}/reward_mean"] = reward_mean
                metrics[f"turn_{turn + 1}/expected_return"] = expected_return
        kls = [res["reference_kl"] for res in record.learner if "reference_kl" in res]
        for turn in sorted({t for k in kls for t in k}):
            mean = sum(k[turn] for k in kls if turn in k) / sum(1 for k in kls if turn in k)
            metrics[f"turn_{turn + 1}/reference_kl_mean"] = mean
            metrics[f"turn_{turn + 1}/reference_kl_penalty_mean"] = args.reference_kl_coef * mean
        for a, res in enumerate(record.learner):
            lengths = [len(c) for ep in episodes for node in ep.nodes for c in node.token_ids[a]]
            metrics[f"agent_{a}/loss"] = res["loss"]
            metrics[f"agent_{a}/completion_length"] = sum(lengths) / max(len(lengths), 1)
            metrics[f"agent_{a}/policy_version"] = record.rollout_versions.get(a, 0)
        metrics["timing/generation_s"] = record.generation
        metrics["timing/learning_s"] = record.learning
        metrics["timing/weight_sync_s"] = record.weight_sync
        metrics["throughput/generation_tokens_per_s"] = record.tokens / max(record.generation, 1e-9)
        metrics["train/epoch"] = self.epoch + 1
        self.log(metrics, step)

    last_train_log = -1

    # ---- checkpoints

    def save_checkpoint(self) -> None:
        """Learners write their folders into a staging dir; the checkpointer publishes it."""
        from workers.launch import ray_get

        self.wait_checkpoint()
        staging = ray_get(self.checkpointer.begin.remote(self.epoch), "checkpointer")
        ray_get([l.save.remote(str(Path(staging) / f"agent_{a}"))
                 for a, l in enumerate(self.learners)], "learners saving")
        metadata = {
            "env_step": self.t.env_step, "epoch": self.epoch, "update_index": self.update_index,
            "epoch_cursor": {"epoch": self.epoch, "prompt_index": 0},
            "last_logged_step": self.wandb.last_step, "last_train_log": self.last_train_log,
            "policy_versions": list(self.versions),
            "wandb": self.wandb.identity or {}, "run_uid": self.run_uid,
            "fingerprints": self.fingerprints, "created": time.time(),
        }
        import numpy as np
        import torch

        driver_state = {"python": random.getstate(), "numpy": np.random.get_state(),
                        "torch": torch.random.get_rng_state()}
        self.pending_checkpoint = self.checkpointer.commit.remote(self.epoch, metadata, driver_state)

    def wait_checkpoint(self) -> str | None:
        from workers.launch import ray_get

        if self.pending_checkpoint is None:
            return None
        ref, self.pending_checkpoint = self.pending_checkpoint, None
        return ray_get(ref, "checkpointer writing")

    def pull_weights(self) -> None:
        """Copy the learners' final weights into the trainer's agents (for save_model)."""
        import torch

        from workers.launch import ray_get

        states = ray_get([l.get_weights.remote() for l in self.learners], "learners")
        with torch.no_grad():
            for model, state in zip(self.t._initial_models(), states):
                model.load_state_dict(state, strict=False)


def _turn_stats(episodes: list[Episode]) -> list[tuple[float, float, int]]:
    """Per turn: mean of node mean rewards, mean of node mean returns, node count."""
    per_turn: dict[int, list[tuple[float, float]]] = {}
    for ep in episodes:
        for node in ep.nodes:
            per_turn.setdefault(node.turn, []).append(
                (sum(node.rewards) / len(node.rewards), sum(node.returns) / len(node.returns)))
    out = []
    for turn in range(max(per_turn) + 1 if per_turn else 0):
        vals = per_turn.get(turn, [])
        n = len(vals)
        out.append((sum(v[0] for v in vals) / max(n, 1), sum(v[1] for v in vals) / max(n, 1), n))
    return out
