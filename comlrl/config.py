"""MAGRPOConfig: comlrl 1.4.3's fields and defaults, plus this project's rollout/placement fields.

Every field is validated in `__post_init__` with a `ValueError` that names the field; the
comlrl ones keep comlrl's wording so code written against comlrl keeps matching its errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

ADVANTAGE_MODES = ("mean", "raw", "max", "rloo")
JOINT_MODES = ("aligned", "align", "cross", "crossed")
ROLLOUT_ENGINES = ("vllm", "hf")
LOSS_AGGREGATIONS = ("sequence", "token_mean")

# Settings that may differ between a checkpointed run and its resume: they change where and how
# fast the run executes, or how often it logs, never what it computes.
RESUMABLE_FIELDS = frozenset({
    "num_train_epochs", "logging_steps", "rollout_workers_per_agent", "rollout_num_cpus",
    "rollout_num_gpus", "learner_num_cpus", "learner_num_gpus", "rollout_threads",
    "learner_threads", "ray_address", "gpu_memory_utilization", "kv_cache_memory_bytes",
    "tensor_parallel_size", "learner_device", "single_gpu", "enable_sleep_mode", "verbose",
    "eval_interval", "eval_num_samples", "eval_batch_size", "rollout_resources",
    "learner_resources", "weight_transport", "placement_timeout_s",
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
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    """KV-cache bytes per vLLM engine on CPU (vLLM's CPU backend needs an explicit size)."""
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
    weight_transport: str = "auto"
    """Learner-to-engine weight push: 'object_store' (Ray object store; works everywhere),
    'nccl' (bucketed broadcast from the learner to its engines; gloo when tensors are on CPU),
    'cuda_ipc' (engines on the learner's GPU read its buffers), or 'auto' (cuda_ipc with
    single_gpu, nccl when learners and engines have GPUs, else object_store)."""
    single_gpu: bool = False
    """Preset: learner and engines share one GPU (fractional GPUs, sleep mode between rollouts)."""
    enable_sleep_mode: bool = False
    """Let vLLM release GPU memory while the learner trains (GPU only)."""
    verbose: bool = True
    """Show tqdm progress bars."""
    extra: dict = field(default_factory=dict)
    """Free-form settings recorded in W&B and checkpoints (not interpreted)."""

    def __post_init__(self) -> None:
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
        self.joint_mode = str(self.joint_mode).lower()
        if self.joint_mode not in JOINT_MODES:
            raise ValueError(
                f"Unsupported joint_mode: {self.joint_mode!r}; use 'aligned' or 'cross'."
            )
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
        if not 0 < self.gpu_memory_utilization < 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1) (got {self.gpu_memory_utilization!r})."
            )
        if self.kv_cache_memory_bytes < 1 << 20:
            raise ValueError(
                f"kv_cache_memory_bytes must be at least 1 MiB (got {self.kv_cache_memory_bytes!r})."
            )
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
        if not self.placement_timeout_s > 0:
            raise ValueError(
                f"placement_timeout_s must be > 0 (got {self.placement_timeout_s!r}).")
        if self.weight_transport not in ("auto", "object_store", "nccl", "cuda_ipc"):
            raise ValueError(
                f"weight_transport must be 'auto', 'object_store', 'nccl' or 'cuda_ipc' "
                f"(got {self.weight_transport!r}).")
        if self.single_gpu:
            # One GPU shared by every actor: workers.launch.plan_placement gives each actor a
            # fraction of it and each engine a part of gpu_memory_utilization.
            if self.tensor_parallel_size != 1:
                raise ValueError(f"single_gpu needs tensor_parallel_size=1 "
                                 f"(got {self.tensor_parallel_size!r}).")
            self.enable_sleep_mode = True

    @property
    def cross(self) -> bool:
        return self.joint_mode in ("cross", "crossed")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
