"""MAGRPOTrainer: the comlrl-facing trainer and its loop. It owns the only W&B run; Ray
actors do the work, started and stopped by `workers.driver.session.Session`.

    rollout (engines) -> reward -> advantages -> update (learners) -> push weights -> log
    -> checkpoint (checkpointer)

docs/architecture.md maps every concern to the file that owns it.
"""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

from comlrl import rewards
from comlrl.checkpoint import read_checkpoint_metadata, recover_interrupted_commits
from comlrl.checkpoint_dir import check_checkpoint_dir
from comlrl.config import MAGRPOConfig, RESUMABLE_FIELDS
from comlrl.evaluation import run_evaluation
from comlrl.fingerprints import (
    fingerprint_callable,
    fingerprint_model_folder,
    fingerprint_rows,
    fingerprint_tokenizer,
)
from comlrl.inputs import build_formatters, dataset_rows, resolve_agent_sources, resolve_tokenizers
from comlrl.loading import load_once
from comlrl.lora import (
    check_peft_config,
    is_peft_model,
    make_lora_agents,
    resume_settings,
)
from comlrl.rollout import Node, run_episode_batch, StepRecord
from comlrl.trainers.reinforce import manual_save
from comlrl.trainers.reinforce.compat import (
    check_generation_kwargs,
    engine_for_head_dim,
    reference_copies,
)


class MAGRPOTrainer:
    """Multi-agent GRPO with vLLM rollout workers and per-agent learners on Ray.

    Arguments follow comlrl 1.4.3: `agents=[HF models or names]` or `agent_model="name-or-path"`
    with `num_agents`, `tokenizer` (one, or one per agent; loaded from the names if omitted),
    `reward_func(completions_agent0, ...)`,
    `train_dataset` with a `prompt` column, `args=MAGRPOConfig(...)`, `wandb_config` (None: no
    W&B). Constructing it validates everything and starts nothing heavy.

    `peft_config=peft.LoraConfig(...)` (TRL's convention; not in comlrl) makes every agent a
    LoRA agent: `trainer.agents` become `peft.PeftModel`s and only their adapters are
    trained. Agents handed over as PeftModels are LoRA agents without it.
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
                 args: MAGRPOConfig | None = None, peft_config: Any = None):
        # Checks run in comlrl 1.4.3's order, with its error words, so the first problem a
        # user sees is the one comlrl would report.
        self.args = args if args is not None else self.default_config_cls()
        if not isinstance(self.args, MAGRPOConfig):
            raise ValueError(f"args must be a MAGRPOConfig (got {type(self.args).__name__}).")
        if agent_model is None and agents is None:
            raise ValueError("Either agent_model or agents must be provided.")
        if agents is None and not isinstance(agent_model, str):
            raise ValueError("agent_model should be a string to create homogeneous agents")
        if reward_func is None or not callable(reward_func):
            raise ValueError("reward_func must be a callable.")
        sources, self.model_name = resolve_agent_sources(agent_model, agents, num_agents)
        self.num_agents = len(sources)
        if agents is not None and agent_model is None:
            self.args.num_agents = self.num_agents
        self.agent_model = agent_model
        check_peft_config(peft_config)
        self.peft_config = peft_config
        self.model_sources = sources  # a model name (or path) per agent, or the models
        self.agents = None if all(isinstance(x, str) for x in sources) else list(sources)
        if self.agents is not None:   # LoRA agents now; models given by name when loaded
            self.agents = self.model_sources = make_lora_agents(self.agents, peft_config,
                                                                self.args.seed)
        self.model_config = dict(model_config or {})
        self.formatters = build_formatters(formatters, self.num_agents)
        self.reward_func = reward_func
        self.reward_style = rewards.reward_call_style(reward_func, self.num_agents)
        self.reward_processor = reward_processor
        self.tokenizers = resolve_tokenizers(tokenizer, sources, self.model_config)
        self.tokenizer = self.tokenizers[0]
        self.args.check_joint_mode(self.num_agents)
        self.args.check_devices(self.num_agents)
        if self.args.num_turns > 1 and external_transition is None:
            raise ValueError("Multi-turn MAGRPO requires an external_transition.")
        self.external_transition = external_transition
        # Like comlrl, a trainer may be built without a train_dataset; train() needs one.
        self.train_rows = dataset_rows(train_dataset, "train_dataset")
        self.eval_rows = dataset_rows(eval_dataset, "eval_dataset")
        self.wandb_config = wandb_config
        self.eval_logger = eval_logger
        self.eval_aggregator = eval_aggregator
        engine_for_head_dim(self)
        self.env_step = 0
        self._final_state: Any = None   # what save_checkpoint saves (`manual_save`)
        self._reference_models: list | None = None
        self._session = None  # the running workers.driver.session.Session, during train()
        self.last_wandb_identity: dict | None = None  # the W&B run train() logged to

    # ------------------------------------------------------------------ public API

    def train(self, resume_from_checkpoint: str | None = None, checkpoint_dir: str | None = None,
              checkpoint_interval: int = 1, checkpoint_total_limit: int | None = None,
              **kwargs: Any) -> None:
        """Train to `num_train_epochs` (the whole run's total), checkpointing every
        `checkpoint_interval` epochs and after the last one into `checkpoint_dir/checkpoint-N`.
        The positional order is comlrl 1.4.3's: `train("runs/x/checkpoint-2")` resumes.

        `**kwargs` are comlrl's generation options for the training rollouts (it passes them
        to HF `generate`): accepted where they change nothing here (`generation_kwargs`)."""
        if isinstance(checkpoint_interval, bool) or not isinstance(checkpoint_interval, int) \
                or checkpoint_interval < 1:
            raise ValueError("checkpoint_interval must be a positive integer.")
        if checkpoint_total_limit is not None and checkpoint_total_limit < 1:
            raise ValueError("checkpoint_total_limit must be None or >= 1.")
        if self.train_rows is None:
            raise ValueError("Trainer: training requires a train_dataset (a datasets.Dataset "
                             "with a 'prompt' column); pass train_dataset= to MAGRPOTrainer.")
        check_generation_kwargs(self.args, kwargs)
        resume_meta = self._check_resume(checkpoint_dir, resume_from_checkpoint)
        from workers.runtime import ActorFailure, Session

        if self.args.reference_kl_enabled and self.agents is not None \
                and not all(isinstance(s, str) for s in self.model_sources):
            reference_copies(self)   # comlrl's copies are of the weights before training
        # Until this train() completes, save_checkpoint refuses (comlrl: no boundary reached).
        self._final_state = "failed"
        # comlrl's words for a save while train() runs depend on its checkpoint arguments.
        self._save_refusal = manual_save.BLOCKED_DURING if (
            resume_from_checkpoint is not None or checkpoint_dir is not None
            or checkpoint_interval != 1 or checkpoint_total_limit is not None) \
            else manual_save.BLOCKED_AFTER_FAILURE
        with Session(self, checkpoint_dir, checkpoint_total_limit, resume_from_checkpoint,
                     resume_meta) as session:
            self._session = session
            try:
                while True:
                    try:
                        self._train_loop(session, checkpoint_dir, checkpoint_interval)
                        break
                    except ActorFailure as failure:
                        # A dead learner or checkpointer: restart them from the newest
                        # checkpoint and go on (anything else is raised again).
                        session.heal(failure)
                manual_save.record_final_state(self, session)
            finally:
                self._session = None
        manual_save.note_parked(self)

    def save_checkpoint(self, output_dir: str) -> str:
        """comlrl's manual save: the trainer's state now (before any `train()`, the initial
        one; after a completed `train()`, its final one) as a checkpoint folder at
        `output_dir` that `train(resume_from_checkpoint=output_dir)` continues from. Refused
        while `train()` runs or after one that raised (RuntimeError), and over a folder that
        is not a checkpoint (FileExistsError). Returns the folder's absolute path."""
        return manual_save.save_checkpoint(self, output_dir)

    @property
    def reference_models(self) -> list:
        """comlrl's frozen reference copies, one per agent ([] without `reference_kl_enabled`):
        the initial weights, `requires_grad` off, in eval mode. Here the learners hold the
        copies they train against; these are the driver's, built at first read (models given
        as objects: by the first `train()`, before it changes them)."""
        return reference_copies(self)

    def _train_loop(self, session: Any, checkpoint_dir: str | None, interval: int) -> None:
        """comlrl's cadence: prompts in dataset order, each prompt's whole rollout tree, its
        nodes into a buffer; every `rollout_buffer_size` waiting nodes are one update (and
        the rest at the epoch's end), pushed to the engines before the next rollout. A
        single-turn tree is one node, so the prompts up to the next update are generated in
        one round of engine calls; a multi-turn tree's size is known only once it is grown."""
        args, rows = self.args, self.train_rows
        total_epochs, size = args.num_train_epochs, args.rollout_buffer_size
        from tqdm.auto import tqdm

        # Closed also when a step raises: a bar left open prints again at interpreter exit.
        with tqdm(total=(total_epochs - session.progress.epoch) * len(rows), desc="MAGRPO",
                  unit="prompt", disable=not args.verbose, dynamic_ncols=True) as bar:
            if self.env_step == 0 and self._eval_due(0):
                session.log(self._evaluate_now(session), 0)
            for epoch in range(session.progress.epoch, total_epochs):
                buffer: list[Node] = []
                start = 0
                while start < len(rows):
                    count = max(1, size - len(buffer)) if args.num_turns == 1 else 1
                    batch = list(range(start, min(start + count, len(rows))))
                    start = batch[-1] + 1
                    record = rollout = StepRecord()
                    episodes = run_episode_batch(self, session, epoch, batch, record)
                    # Evaluations due inside this round see the same weights as their prompt
                    # would; each logs at the env_step its prompt started at.
                    for ep in episodes[1:]:
                        if self._eval_due(ep.row_index):
                            session.log(self._evaluate_now(session), ep.env_step_before)
                    buffer += [node for ep in episodes for node in ep.nodes]
                    epoch_end = start >= len(rows)
                    updates = []
                    while len(buffer) >= size or (epoch_end and buffer):
                        nodes, buffer = buffer[:size], buffer[size:]
                        session.update_and_push(nodes, record)
                        updates.append((nodes, record))
                        record = StepRecord(policy_versions=dict(record.policy_versions))
                    # The evaluation before the next prompt runs now, with the new weights, and
                    # shares the last update's log line (the same env_step) if there was one.
                    upcoming = 0 if epoch_end else start
                    extra = self._evaluate_now(session) if self._eval_due(upcoming) else {}
                    for i, (nodes, step_record) in enumerate(updates):
                        last = i == len(updates) - 1
                        session.log_step(nodes, step_record, extra if last else {},
                                         max(node.env_step for node in nodes))
                    if extra and not updates:
                        session.log(extra, self.env_step)
                    roots = [r for ep in episodes for r in ep.root.rewards]
                    bar.update(len(batch))
                    bar.set_postfix(env_step=self.env_step,
                                    reward=f"{sum(roots) / len(roots):.3f}",
                                    tok_s=f"{rollout.tokens / max(rollout.generation, 1e-9):.0f}")
                session.progress.epoch = epoch + 1
                if checkpoint_dir and (session.progress.epoch % interval == 0
                                       or session.progress.epoch == total_epochs):
                    session.save_checkpoint()
        session.wait_checkpoint()
        session.pull_weights()

    def _eval_due(self, prompt_index: int) -> bool:
        interval = self.args.eval_interval
        return bool(self.eval_rows) and interval > 0 and prompt_index % interval == 0 \
            and self.args.eval_num_samples > 0

    def _evaluate_now(self, session: Any) -> dict[str, float]:
        return run_evaluation(self, session, self.args.eval_num_samples)

    def _eval_completions(self, episodes: list) -> list:
        """The evaluation logger's `agent_completions_turns`: per agent, per episode, the text
        of its one sample at every turn."""
        return [[[node.texts[a][0] for node in ep.nodes] for ep in episodes]
                for a in range(self.num_agents)]

    def evaluate(self, num_eval_samples: int | None = None) -> dict[str, float]:
        """Evaluate on `eval_dataset` and log under `eval/` at the current env_step."""
        from workers.runtime import Session

        if self._session is not None:
            metrics = run_evaluation(self, self._session, num_eval_samples)
            self._session.log(metrics, self.env_step)
            return metrics
        with Session(self, for_eval=True) as session:
            metrics = run_evaluation(self, session, num_eval_samples)
            session.log(metrics, self.env_step)
            return metrics

    def save_model(self, output_dir: str, merge: bool = False) -> list[str]:
        """Write one `from_pretrained` folder per agent: output_dir/agent_0, agent_1, ...

        After `train()` the agents hold the trained weights. A LoRA agent's folder is its
        PEFT adapter (`PeftModel.from_pretrained(base, folder)` loads it); with `merge=True`,
        the adapter merged into a copy of its base, a plain `from_pretrained` folder."""
        out = Path(output_dir)
        paths = []
        for i, model in enumerate(self._initial_models()):
            if merge and is_peft_model(model):
                model = copy.deepcopy(model).merge_and_unload()
            model.save_pretrained(out / f"agent_{i}", safe_serialization=True)
            self.tokenizers[i].save_pretrained(out / f"agent_{i}")
            paths.append(str(out / f"agent_{i}"))
        return paths


    # ------------------------------------------------------------------ validation

    def _initial_models(self) -> list:
        """The agents' models; given as names (`agent_model`, or `agents=[names]`), they are
        loaded here, at first use, not at construction."""
        return load_once(self, "agents", self.model_sources, self.model_config,
                         prepare=lambda models: make_lora_agents(models, self.peft_config,
                                                                 self.args.seed))

    def _check_resume(self, checkpoint_dir: str | None, resume: str | None) -> dict | None:
        """Read the checkpoint to resume from (its files are verified by the Session while
        it saves the models); refuse a checkpoint_dir that holds anything this run does not
        own (`comlrl.checkpoint.check_checkpoint_dir`)."""
        meta = None
        if checkpoint_dir:
            # A crash between a commit's two renames leaves the only whole copy in `.trash-`;
            # put it back first, so that the checkpoint to resume from is there.
            recover_interrupted_commits(checkpoint_dir)
        if resume is not None:
            meta = read_checkpoint_metadata(resume)
        if checkpoint_dir:
            check_checkpoint_dir(checkpoint_dir, meta)
        return meta

    def _user_callables(self) -> dict:
        """The user's callables a resume must not change, by fingerprint key (a list: one per
        agent). A trainer that wraps them (the centralized one) names the user's own here."""
        return {"reward_func": self.reward_func, "reward_processor": self.reward_processor,
                "external_transition": self.external_transition,
                "formatters": [getattr(f, "user", None) for f in self.formatters]}

    def fingerprints(self, model_folders: list[str]) -> dict:
        """What must not change between a checkpoint and its resume."""
        cfg = {k: v for k, v in self.args.to_dict().items() if k not in RESUMABLE_FIELDS}
        warn = not self.args.skip_callable_fingerprints

        def callable_print(func: Any, label: str) -> str | None:
            return fingerprint_callable(func, label, warn=warn)

        # One thread per model: hashlib's sha256 releases the GIL, so the models hash in parallel.
        with ThreadPoolExecutor(max(1, len(model_folders))) as pool:
            models = list(pool.map(fingerprint_model_folder, model_folders))

        callables = {key: [callable_print(f, f"{key}[{i}]") for i, f in enumerate(value)]
                     if isinstance(value, list) else callable_print(value, key)
                     for key, value in self._user_callables().items()}
        lora = resume_settings(self._initial_models())
        return {
            "config": cfg,
            **({"peft_config": lora} if lora is not None else {}),
            "num_agents": self.num_agents,
            "dataset": fingerprint_rows(self.train_rows),
            "eval_dataset": fingerprint_rows(self.eval_rows),
            **callables,
            "models": models,
            "tokenizers": [fingerprint_tokenizer(t) for t in self.tokenizers],
        }
