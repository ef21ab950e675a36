"""MAGRPOConfig: comlrl 1.4.3's fields and defaults, plus this project's rollout/placement fields.

Every field is validated in `__post_init__` with a `ValueError` that names the field; the
comlrl ones keep comlrl's wording so code written against comlrl keeps matching its errors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Optional, Sequence, Union

ADVANTAGE_MODES = ("mean", "raw", "max", "rloo")
JOINT_MODES = ("aligned", "align", "cross", "crossed")
PARALLEL_TRAINING_MODES = ("none", "mp")

DeviceSpec = Union[str, Sequence[str]]

# Device types torch knows besides cpu/cuda: a learner here runs on 'cpu' or 'cuda' only.
_OTHER_TORCH_DEVICES = ("ipu xpu mkldnn opengl opencl ideep hip ve fpga maia xla lazy vulkan mps "
                        "meta hpu mtia privateuseone").split()
ROLLOUT_ENGINES = ("vllm", "hf")
LOSS_AGGREGATIONS = ("sequence", "token_mean")

WEIGHT_TRANSPORTS = ("auto", "object_store", "nccl", "cuda_ipc")
"""The names `weight_transport` accepts ('auto' resolves to one of the other three)."""
DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
"""Default `weight_bucket_bytes`: the most bytes one bucket of a bucketed weight push holds."""

# Settings that may differ between a checkpointed run and its resume: they change where and how
# fast the run executes, or how often it logs, never what it computes.
RESUMABLE_FIELDS = frozenset({
    "num_train_epochs", "logging_steps", "rollout_workers_per_agent", "rollout_num_cpus",
    "rollout_num_gpus", "learner_num_cpus", "learner_num_gpus", "rollout_threads",
    "learner_threads", "ray_address", "gpu_memory_utilization", "kv_cache_memory_bytes",
    "tensor_parallel_size", "learner_device", "single_gpu", "enable_sleep_mode", "verbose",
    "eval_interval", "eval_num_samples", "eval_batch_size", "rollout_resources",
    "learner_resources", "weight_transport", "placement_timeout_s",
    # comlrl's placement fields: where agents and reference copies live, never what they compute.
    "agent_devices", "parallel_training", "reference_devices",
    "weight_bucket_bytes", "skip_callable_fingerprints", "max_actor_restarts", "colocate",
    "memory_check", "gradient_checkpointing",
})


@dataclass
class MAGRPOConfig:
    """Configuration for MAGRPO training (comlrl-compatible)."""

    # ---- comlrl 1.4.3 fields, same names and defaults ----
    num_train_epochs: int = 20
    """Total epochs of the whole run (a resumed run counts the epochs already done)."""
    agent_learning_rate: float = 5.0e-6
    """AdamW learning rate of every agent (weight decay 0.01)."""
    logging_steps: int = 50
    """Log a training point when env_step advanced by at least this much since the last one."""
    num_agents: int = 2
    """Number of cooperating agents (used with `agent_model`; `agents=[...]` sets it)."""
    parallel_training: str = "none"
    """comlrl's agent scheduling, accepted as comlrl accepts it: 'none' ('null', '', None) or
    'mp' (needs explicit `agent_devices`). Here every agent always trains in its own learner,
    in parallel; the field only decides how `agent_devices` is read, as in comlrl: with 'none'
    the first entry is every agent's device, with 'mp' entry i is agent i's."""
    agent_devices: Optional[DeviceSpec] = None
    """Device of each agent's learner: None/'auto' (`learner_device` decides), 'cpu', 'cuda',
    'cuda:N', or a list (one entry, or one per agent with 'mp'). 'cuda:N' means "a GPU" (Ray
    gives the actor its GPU, `learner_num_gpus`); other torch device types are refused."""
    num_generations: int = 4
    """K: completions sampled per prompt per agent (>= 2, the group baseline needs several)."""
    max_new_tokens: int = 256
    """Most tokens generated per completion."""
    temperature: float = 0.6
    """Sampling temperature (> 0)."""
    top_p: float = 0.6
    """Nucleus sampling mass, in (0, 1]."""
    top_k: Optional[int] = 50
    """Top-k sampling; None or 0 disables it."""
    num_turns: int = 2
    """Turns per episode; > 1 needs an `external_transition`."""
    discount: float = 1.0
    """Discount applied to the mean child return in multi-turn returns."""
    joint_mode: str = "aligned"
    """'aligned': joint action j is completion j of every agent (K). 'cross': all K^N combinations."""
    early_termination_threshold: Optional[float] = -0.2
    """A multi-turn branch whose mean reward exceeds this is not expanded further (None: never)."""
    external_prompt_passthrough: bool = False
    """Pass the transition's prompts to the model as they are, bypassing the formatters."""
    eval_interval: int = 16
    """Evaluate before every eval_interval-th training prompt (0: never)."""
    eval_num_samples: int = 4
    """Evaluation prompts per evaluation."""
    eval_batch_size: int = 1
    """Evaluation prompts per engine call."""
    rollout_buffer_size: int = 2
    """Prompts per update: each agent is updated once every rollout_buffer_size prompts."""
    train_batch_size: Optional[int] = None
    """Prompts per mini-batch within an update (None: rollout_buffer_size)."""
    advantage_normalization: bool = True
    """Z-score each group's advantages with the population std (clamped at 1e-6)."""
    advantage_mode: str = "mean"
    """Group baseline: 'mean', 'raw' (none), 'max', or 'rloo' (leave-one-out)."""
    reference_kl_enabled: bool = False
    """Shape returns with a KL penalty to a frozen copy of the initial model."""
    reference_kl_coef: float = 0.1
    """Weight of the reference KL penalty."""
    reference_devices: Optional[DeviceSpec] = None
    """Where the frozen reference copies live (comlrl's rules; checked only with
    `reference_kl_enabled`). Here agent i's copy always lives in agent i's learner, on its
    device: None/'auto' mean that, an explicit device must be agent i's, never silently moved."""

    # ---- this project's fields ----
    seed: int = 42
    """Root of every random draw: sampling seeds and shuffles derive from it and counters."""
    rollout_engine: str = "vllm"
    """'vllm' (vLLM engines) or 'hf' (Hugging Face generate, for machines without vLLM)."""
    loss_aggregation: str = "sequence"
    """'sequence': minus summed token log-probs times advantage (comlrl); 'token_mean': per token."""
    engine_dtype: str = "auto"
    """Weights dtype inside the rollout engines ('auto' follows the model's config)."""
    enforce_eager: bool = True
    """Run vLLM without graph capture/compilation (fast start; set False for GPU throughput)."""
    max_model_len: Optional[int] = None
    """Longest prompt+completion the engine accepts (None: the model's maximum)."""
    kv_cache_memory_bytes: Optional[int] = None
    """KV-cache bytes per vLLM engine on CPU. None: room for the run's largest engine call,
    its sequences as long as they can get, at most 256 MiB (`engines.cpu_kv_cache_bytes`)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of a GPU one vLLM engine may take (kept < 1 so a learner can share the GPU)."""
    tensor_parallel_size: int = 1
    """GPUs per vLLM engine."""
    rollout_workers_per_agent: int = 1
    """Rollout actors per agent; the prompts of a step are split across them."""
    rollout_num_cpus: float = 0.5
    """Ray CPUs reserved per rollout worker."""
    rollout_num_gpus: float = 0.0
    """Ray GPUs per rollout worker (fractions share a GPU)."""
    learner_num_cpus: float = 0.5
    """Ray CPUs reserved per learner actor (one learner actor per agent)."""
    learner_num_gpus: float = 0.0
    """Ray GPUs per learner actor."""
    rollout_threads: Optional[int] = None
    """Torch threads inside each rollout worker (None: the machine's cores / rollout actors)."""
    learner_threads: Optional[int] = None
    """Torch threads inside each learner (None: the machine's cores / learner actors)."""
    learner_device: str = "auto"
    """Learner device: 'auto' (cuda when the actor has a GPU), 'cpu' or 'cuda'."""
    ray_address: Optional[str] = None
    """Ray cluster to join (None: RAY_ADDRESS if set, else start a local Ray)."""
    rollout_resources: dict = field(default_factory=dict)
    """Ray custom resources per rollout worker, to pin workers to nodes that offer them
    (e.g. {"rollout_node": 1} with `ray start --resources='{"rollout_node": 4}'`)."""
    learner_resources: dict = field(default_factory=dict)
    """Ray custom resources per learner actor (pins learners like `rollout_resources`)."""
    placement_timeout_s: float = 300.0
    """Seconds to wait for Ray to reserve every actor's resources before failing."""
    max_actor_restarts: int = 3
    """Times one run may restart its learners and checkpointer after one of them dies, each
    time restoring every learner from the newest checkpoint (values stay the same as an
    uninterrupted run); past it the run fails, naming the actor and how to resume."""
    memory_check: bool = True
    """Before any actor starts, estimate the memory the run needs on this machine (or GPU)
    from the agents' parameter counts and the layout, and refuse a run that will not fit,
    naming the settings that help (`workers/driver/memory.py`); False skips the check."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them
    from the forward (transformers' non-reentrant checkpointing): an update holds about one
    layer's activations instead of all of them, for one more forward of compute. The values
    are the same bit for bit on CPU (the forward is replayed exactly), so a run may resume with
    it changed. comlrl 1.4.3 has no such setting."""
    weight_bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Bucket size of the bucketed broadcast / CUDA IPC weight transports (>= 1 MiB): weights
    travel in buckets of at most this many bytes. Replaces the environment variable
    COMLRL_WEIGHT_BUCKET_BYTES."""
    skip_callable_fingerprints: bool = False
    """Skip the resume check of callables (reward, transition, formatters) that cannot be
    fingerprinted."""
    weight_transport: str = "auto"
    """Learner-to-engine weight push: 'object_store' (Ray object store; works everywhere),
    'nccl' (bucketed broadcast from the learner to its engines; gloo when tensors are on CPU),
    'cuda_ipc' (engines on the learner's GPU read its buffers), or 'auto' (cuda_ipc with
    single_gpu, nccl when learners and engines have GPUs, else object_store)."""
    colocate: Union[bool, str] = "auto"
    """Host each agent's learner in the same actor as its first rollout engine (workers/
    colocated.py): one process per agent instead of two, and the push to that engine is an
    in-process copy. Computes what the split layout computes (a run may resume either way);
    further workers (`rollout_workers_per_agent` > 1) stay separate actors. 'auto': colocated
    on a local Ray the trainer starts, on CPU (faster there, BENCHMARKS.md); split when
    joining a cluster or a running Ray, or when learners or engines ask for GPUs."""
    single_gpu: bool = False
    """Preset: learner and engines share one GPU (fractional GPUs, sleep mode between rollouts)."""
    enable_sleep_mode: bool = False
    """Let vLLM release GPU memory while the learner trains (GPU only)."""
    verbose: bool = True
    """Show tqdm progress bars. Either way the console stays short: the actors' own output
    (vLLM, Ray, transformers, torch) goes to one log file per actor (`workers/console.py`).
    "full" (or the environment variable COMLRL_VERBOSE=1) puts all of it on the console."""
    extra: dict = field(default_factory=dict)
    """Free-form settings recorded in W&B and checkpoints (not interpreted)."""

    def __post_init__(self) -> None:
        """Validate every field, raising a ValueError that names the first bad one, and fill in
        the derived values (train_batch_size, the lower-cased modes, single_gpu's sleep mode).
        The checks run in a fixed order, so the same config always reports the same error."""
        self._check_counts()
        self._check_algorithm_fields()
        self._check_actor_resources()
        self._check_run_control_fields()
        self._check_weight_push_fields()
        if not isinstance(self.skip_callable_fingerprints, bool):
            raise ValueError(f"skip_callable_fingerprints must be True or False "
                             f"(got {self.skip_callable_fingerprints!r}).")
        self._check_colocate()
        self._check_placement_fields()
        self._apply_single_gpu()

    # ---------------------------------------------------------------- field checks

    def _check_counts(self) -> None:
        """Epochs, agents, batch sizes, turns and evaluation counts; defaults train_batch_size."""
        positive_ints = ("num_train_epochs", "num_agents", "rollout_buffer_size", "num_turns",
                         "logging_steps", "eval_batch_size", "max_new_tokens",
                         "tensor_parallel_size", "rollout_workers_per_agent")
        for name in positive_ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be >= 1 (got {value!r}).")
        if not isinstance(self.num_generations, int) or self.num_generations < 2:
            raise ValueError(
                f"num_generations must be >= 2 (group baseline requires multiple samples); "
                f"got {self.num_generations!r}."
            )
        for name in ("eval_interval", "eval_num_samples"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (got {getattr(self, name)!r}).")
        if self.train_batch_size is None:
            self.train_batch_size = self.rollout_buffer_size
        if self.train_batch_size < 1:
            raise ValueError(f"train_batch_size must be >= 1 (got {self.train_batch_size!r}).")

    def _check_algorithm_fields(self) -> None:
        """What the run computes: learning rate, sampling, discount, advantage and joint modes,
        rollout engine, loss aggregation and the reference KL weight."""
        if not self.agent_learning_rate > 0:
            raise ValueError(f"agent_learning_rate must be > 0 (got {self.agent_learning_rate!r}).")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (got {self.temperature!r}).")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p!r}).")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be None or >= 0 (got {self.top_k!r}).")
        if not 0 <= self.discount <= 1:
            raise ValueError(f"discount must be in [0, 1] (got {self.discount!r}).")
        self.advantage_mode = str(self.advantage_mode).lower()
        if self.advantage_mode not in ADVANTAGE_MODES:
            raise ValueError(
                f"advantage_mode must be one of: mean, raw, max, rloo (got {self.advantage_mode!r})."
            )
        # comlrl's config accepts any joint_mode; it is read only with several agents (one
        # agent: aligned, whatever it says). The trainer checks it with its real agent count.
        self.joint_mode = str(self.joint_mode).lower()
        if self.rollout_engine not in ROLLOUT_ENGINES:
            raise ValueError(
                f"rollout_engine must be 'vllm' or 'hf' (got {self.rollout_engine!r})."
            )
        if self.loss_aggregation not in LOSS_AGGREGATIONS:
            raise ValueError(
                f"loss_aggregation must be 'sequence' or 'token_mean' "
                f"(got {self.loss_aggregation!r})."
            )
        if self.reference_kl_coef < 0:
            raise ValueError(f"reference_kl_coef must be >= 0 (got {self.reference_kl_coef!r}).")

    def _check_actor_resources(self) -> None:
        """What each actor gets: engine memory, Ray CPUs/GPUs, torch threads, learner device and
        Ray custom resources."""
        if not 0 < self.gpu_memory_utilization < 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1) (got {self.gpu_memory_utilization!r})."
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1 << 20:
            raise ValueError(f"kv_cache_memory_bytes must be None or at least 1 MiB "
                             f"(got {self.kv_cache_memory_bytes!r}).")
        for name in ("rollout_num_cpus", "rollout_num_gpus", "learner_num_cpus",
                     "learner_num_gpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (got {getattr(self, name)!r}).")
        for name in ("rollout_threads", "learner_threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be None or >= 1 (got {getattr(self, name)!r}).")
        if self.learner_device not in ("auto", "cpu", "cuda"):
            raise ValueError(
                f"learner_device must be 'auto', 'cpu' or 'cuda' (got {self.learner_device!r})."
            )
        for name in ("rollout_resources", "learner_resources"):
            res = getattr(self, name)
            if not isinstance(res, dict) or any(
                    not isinstance(k, str) or isinstance(v, bool) or
                    not isinstance(v, (int, float)) or v < 0 for k, v in res.items()):
                raise ValueError(f"{name} must be a dict of Ray resource name -> amount >= 0 "
                                 f"(got {res!r}).")
            if {"CPU", "GPU"} & set(res):
                raise ValueError(f"{name}: set CPUs and GPUs with {name[:-10]}_num_cpus / "
                                 f"{name[:-10]}_num_gpus, not as custom resources.")

    def _check_run_control_fields(self) -> None:
        """Actor restarts, the memory check, gradient checkpointing and the placement timeout."""
        if isinstance(self.max_actor_restarts, bool) or not isinstance(
                self.max_actor_restarts, int) or self.max_actor_restarts < 0:
            raise ValueError(f"max_actor_restarts must be an int >= 0 "
                             f"(got {self.max_actor_restarts!r}).")
        if not isinstance(self.memory_check, bool):
            raise ValueError(f"memory_check must be True or False (got {self.memory_check!r}).")
        if not isinstance(self.gradient_checkpointing, bool):
            raise ValueError(f"gradient_checkpointing must be True or False "
                             f"(got {self.gradient_checkpointing!r}).")
        if not self.placement_timeout_s > 0:
            raise ValueError(
                f"placement_timeout_s must be > 0 (got {self.placement_timeout_s!r}).")

    def _check_weight_push_fields(self) -> None:
        """weight_transport (one of WEIGHT_TRANSPORTS), weight_bucket_bytes (an int >= 1 MiB)."""
        if self.weight_transport not in WEIGHT_TRANSPORTS:
            raise ValueError(
                f"weight_transport must be 'auto', 'object_store', 'nccl' or 'cuda_ipc' "
                f"(got {self.weight_transport!r}).")
        if (isinstance(self.weight_bucket_bytes, bool) or
                not isinstance(self.weight_bucket_bytes, int) or
                self.weight_bucket_bytes < 1 << 20):
            raise ValueError(f"weight_bucket_bytes must be an int of at least 1 MiB (1048576) "
                             f"(got {self.weight_bucket_bytes!r}).")

    def _check_colocate(self) -> None:
        """colocate is True, False or 'auto'; True needs the in-process/object-store push."""
        if not (isinstance(self.colocate, bool) or self.colocate == "auto"):
            raise ValueError(f"colocate must be True, False or 'auto' (got {self.colocate!r}).")
        if self.colocate is True and self.weight_transport not in ("auto", "object_store"):
            raise ValueError(f"colocate=True copies weights to each learner's own engine in its "
                             f"process (and through the object store to further workers); "
                             f"leave weight_transport='auto' (got {self.weight_transport!r}).")

    def _apply_single_gpu(self) -> None:
        """single_gpu: needs tensor_parallel_size=1 and turns on enable_sleep_mode."""
        if self.single_gpu:
            # One GPU shared by every actor: workers.driver.placement.plan_placement gives each
            # actor a fraction of it and each engine a part of gpu_memory_utilization.
            if self.tensor_parallel_size != 1:
                raise ValueError(f"single_gpu needs tensor_parallel_size=1 "
                                 f"(got {self.tensor_parallel_size!r}).")
            self.enable_sleep_mode = True

    @property
    def cross(self) -> bool:
        return self.joint_mode in ("cross", "crossed")

    # ---------------------------------------------------------------- joint mode

    def check_joint_mode(self, num_agents: int) -> None:
        """Refuse a joint_mode comlrl would refuse for `num_agents` agents.

        comlrl 1.4.3 accepts any joint_mode in its config and checks it only when several
        agents roll out ("Unsupported joint_mode: <mode>"); one agent is always aligned.
        """
        if num_agents > 1 and str(self.joint_mode).lower() not in JOINT_MODES:
            raise ValueError(
                f"Unsupported joint_mode: {self.joint_mode!r}; use 'aligned' or 'cross' "
                f"(any value is accepted with a single agent)."
            )

    # ---------------------------------------------------------------- devices

    def _check_placement_fields(self) -> None:
        """parallel_training, agent_devices and reference_devices, by comlrl's rules."""
        mode = self.parallel_training or "none"
        mode = str(mode).strip().lower()
        if mode == "null":
            mode = "none"
        if mode not in PARALLEL_TRAINING_MODES:
            raise ValueError("parallel_training only supports: none, mp.")
        if mode == "mp" and self.agent_devices is None:
            raise ValueError("parallel_training='mp' requires explicit agent_devices.")
        self.parallel_training = mode
        entries = _device_entries(self.agent_devices, "agent_devices",
                                  auto_in_list=mode == "none")
        if mode == "none" and entries:
            entries = entries[:1]       # comlrl: without 'mp', the first entry is every agent's
        for entry in entries:
            self._learner_kind(entry)   # refuses a device that contradicts learner_device
        if self.reference_kl_enabled and self.reference_devices is not None:
            refs = _device_entries(self.reference_devices, "reference_devices")
            if len(refs) not in (1, self.num_agents):
                raise ValueError(f"reference_devices length ({len(refs)}) must be 1 or "
                                 f"{self.num_agents}.")
            if mode == "none" or len(entries) in (1, self.num_agents):
                self.check_devices(self.num_agents)

    def _learner_kind(self, entry: str) -> str:
        """'auto', 'cpu' or 'cuda' for one normalised agent_devices entry."""
        if entry == "auto":
            return self.learner_device
        kind = entry.split(":")[0]
        if self.learner_device != "auto" and kind != self.learner_device:
            raise ValueError(
                f"agent_devices {entry!r} contradicts learner_device={self.learner_device!r}; "
                f"set one of them (learner_device='auto' lets agent_devices decide).")
        return kind

    def agent_device_specs(self, num_agents: Optional[int] = None) -> list[str]:
        """Each agent's device as comlrl resolves `agent_devices`, normalised: 'auto', 'cpu',
        'cuda' or 'cuda:N'. `num_agents` defaults to the config's."""
        n = self.num_agents if num_agents is None else int(num_agents)
        if n < 1:
            raise ValueError("agent_devices count must be >= 1.")
        entries = _device_entries(self.agent_devices, "agent_devices",
                                  auto_in_list=self.parallel_training == "none")
        if not entries:
            return ["auto"] * n
        if self.parallel_training == "none" or len(entries) == 1:
            return [entries[0]] * n
        if len(entries) != n:
            raise ValueError(f"agent_devices length ({len(entries)}) must be 1 or {n}.")
        return list(entries)

    def check_devices(self, num_agents: Optional[int] = None) -> None:
        """Validate agent_devices and reference_devices for `num_agents` agents (the trainer's
        real count): comlrl's length rules, and every reference copy on its agent's device."""
        n = self.num_agents if num_agents is None else int(num_agents)
        agents = self.agent_device_specs(n)
        for entry in agents:
            self._learner_kind(entry)
        if not (self.reference_kl_enabled and self.reference_devices is not None):
            return
        refs = _device_entries(self.reference_devices, "reference_devices")
        if refs == ["auto"]:
            return                      # 'auto': wherever its agent is, which is where it lives
        if len(refs) == 1:
            refs = refs * n
        if len(refs) != n:
            raise ValueError(f"reference_devices length ({len(refs)}) must be 1 or {n}.")
        for i, (ref, agent) in enumerate(zip(refs, agents)):
            if not _same_device(ref, agent, self._learner_kind(agent)):
                raise ValueError(
                    f"reference_devices[{i}] = {ref!r} cannot be honoured: agent {i}'s "
                    f"reference copy lives in its learner, on the agent's device "
                    f"({agent!r}, learner_device={self.learner_device!r}). Leave "
                    f"reference_devices None (or 'auto'), or give agent {i} that device with "
                    f"agent_devices.")

    def learner_device_for(self, agent_index: int, num_agents: Optional[int] = None) -> str:
        """The `learner_device` ('auto', 'cpu' or 'cuda') of agent `agent_index`'s learner:
        its `agent_devices` entry mapped onto cpu/cuda, or `learner_device` when that entry is
        None/'auto'. `num_agents` is the trainer's agent count (default: the config's)."""
        n = self.num_agents if num_agents is None else int(num_agents)
        if not 0 <= agent_index < n:
            raise ValueError(f"agent_index {agent_index} is not one of the {n} agents.")
        self.check_devices(n)
        return self._learner_kind(self.agent_device_specs(n)[agent_index])

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _normalise_device(value: object, name: str) -> str:
    """'auto', 'cpu', 'cuda' or 'cuda:N', or a ValueError naming the field."""
    if not isinstance(value, str):
        raise ValueError(f"Unsupported {name} spec: {value!r}.")
    if value.lower() == "auto":
        return "auto"
    if re.fullmatch(r"cpu(:0)?|cuda(:\d+)?", value):
        return "cpu" if value.startswith("cpu") else value
    if value.split(":")[0] in _OTHER_TORCH_DEVICES:
        raise ValueError(f"{name}: {value!r} is a torch device, but learners and their reference "
                         f"copies here run on 'cpu' or 'cuda' only.")
    raise ValueError(f"{name}: {value!r} is not a device; use 'cpu', 'cuda', 'cuda:N' or "
                     f"'auto'.")


def _device_entries(spec: object, name: str, auto_in_list: bool = False) -> list[str]:
    """A device spec as a list of normalised entries ([] for None), with comlrl's errors.

    comlrl reads 'auto' as a whole spec, and inside a list only as its first entry without 'mp'
    (`auto_in_list`); torch refuses it elsewhere."""
    if spec is None:
        return []
    if isinstance(spec, str):
        return [_normalise_device(spec, name)]
    if not isinstance(spec, (list, tuple)):
        raise ValueError(f"Unsupported {name} spec: {spec!r}.")
    if not spec:
        raise ValueError(f"{name} must be a non-empty list or 'auto'.")
    entries = [_normalise_device(v, name) for v in spec]
    for i, entry in enumerate(entries):
        if entry == "auto" and not (auto_in_list and i == 0):
            raise ValueError(f"{name}: 'auto' is accepted as the whole spec, not as list entry "
                             f"{i}; list explicit devices ('cpu', 'cuda', 'cuda:N').")
    return entries


def _same_device(ref: str, agent: str, agent_kind: str) -> bool:
    """Whether a reference entry names the device agent `agent` (kind `agent_kind`) is on."""
    if ref == "auto":
        return True
    ref_kind, _, ref_index = ref.partition(":")
    if agent_kind == "auto" or ref_kind != agent_kind:
        return False
    agent_index = agent.partition(":")[2]
    return not (ref_index and agent_index and ref_index != agent_index)
