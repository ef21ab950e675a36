"""Memory: will the run fit, said before it starts (a kill by Ray's memory monitor is said in
one sentence by `workers.ray_calls.oom_sentence`).

`estimate` adds up what a run holds at its fullest moment (an update), from the agents'
parameter counts and the layout; `check_fits` refuses a run above the memory this machine
has available (or a GPU's memory), naming the settings that help. Pure functions of their
arguments apart from `available_bytes`, so the arithmetic is unit-tested without Ray.
The per-part sizes are those measured by benchmarks/bench_memory.py (BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from comlrl.rollout import longest_sequence
from workers.engines import config_dtype, cpu_kv_cache_bytes

GB = 1e9
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}

PROCESS_BYTES = int(0.6 * GB)
"""Resident memory of one actor process with torch, transformers and vLLM imported, before
any weights (0.45-0.6 GB here)."""
DRIVER_BYTES = int(1.0 * GB)
"""The driver and Ray's own processes (GCS, raylet, dashboard agent, checkpointer)."""
ACTIVATION_FRACTION = 0.75
"""Activations and allocator slack of an update, as bytes per parameter (a learner's
weights + AdamW: 12), where the run's tokens per mini-batch are not known at start."""


SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
"""What `update_activation_bytes` reads of a model's config."""


def update_activation_bytes(config: object, tokens: int, checkpointed: bool) -> int:
    """What one mini-batch of `tokens` (padded) tokens holds in an update, from the model's
    shape (a decoder-only transformers config): every decoder layer's saved activations, or
    with gradient checkpointing each layer's input and one layer recomputed at a time, plus
    four [tokens, vocabulary] tensors of the head (logits, log-softmax, their gradients).
    Calibrated (BENCHMARKS.md section 7) at 358M on the seed example's mini-batch (8 x 76
    tokens): 1.87 GB estimated against 1.82 measured without checkpointing, 0.50 against
    0.45 with it; the head at the real 0.5B vocabulary (151936), 2048 tokens with
    checkpointing: 6.64 against 6.73. Checked by tests/test_learner_memory.py."""
    hidden = config.hidden_size
    per_layer = 4 * (14 * hidden + 4 * config.intermediate_size)   # fp32 bytes per token
    layers = config.num_hidden_layers
    kept = layers * 2 * 4 * hidden + 5 * per_layer if checkpointed else layers * per_layer
    return int(tokens * (kept + 4 * 4 * config.vocab_size))


@dataclass
class Estimate:
    total: int
    parts: dict[str, int]
    """What the total is made of, bytes by part (for the message)."""


def estimate(params: list[int], *, colocated: bool, engines_per_agent: int,
             engine_bytes_per_param: int, reference: bool, kv_cache_bytes: int = 0,
             learner_on_gpu: bool = False, engines_on_gpu: bool = False,
             user_bytes_per_param: int = 4,
             activation_bytes: list[int] | None = None,
             trainable: list[int] | None = None, engineless: list[int] = ()) -> Estimate:
    """Bytes in use at a run's fullest moment on the machine's memory (CPU side).

    Per agent: the learner's fp32 weights (4 bytes per parameter) and AdamW's two moments (8;
    gradients live one parameter at a time, workers/learner.step_in_backward), a reference copy
    (4) with reference KL; a LoRA agent's AdamW holds only its `trainable` parameters' moments
    (its frozen base: 4 bytes per parameter), and the agents in `engineless` (LoRA agents
    whose adapter another agent's engine serves) have no first engine of their own, map
    the base file of that agent's learner (one copy) and update in turn with it (no
    activations of their own);
    activations (`activation_bytes` per agent, from
    `update_activation_bytes`, else ACTIVATION_FRACTION of the 12); each engine's weights in
    its dtype plus its KV cache; one process per learner and per engine (one per agent when
    colocated, for the first engine). The user's own models are file-mapped until the final
    weights come back into new memory of theirs (`user_bytes_per_param`, their dtype) while the
    learners and engines still hold theirs: measured at 358M, that hand-back was the run's
    peak."""
    parts: dict[str, int] = {}
    total_params = sum(params)
    engineless_params = sum(params[a] for a in engineless)
    if not learner_on_gpu:
        # An engineless agent's base is the file its engine's agent maps too: one copy.
        moments = 8 * sum(params if trainable is None else trainable)
        parts["learner weights + AdamW"] = 4 * (total_params - engineless_params) + moments
        # Engineless agents' learners take turns with their engine's agent: one update's
        # working memory per group (workers.roles.learner.UpdateTurns).
        parts["activations"] = (
            sum(b for a, b in enumerate(activation_bytes) if a not in engineless)
            if activation_bytes is not None
            else int(ACTIVATION_FRACTION * 12 * (total_params - engineless_params)))
        if reference:
            parts["reference models"] = 4 * total_params
    if not engines_on_gpu:
        parts["engine weights"] = engine_bytes_per_param * (
            engines_per_agent * total_params - engineless_params)
        parts["KV caches"] = (engines_per_agent * len(params) - len(engineless)) * kv_cache_bytes
    parts["final weights in the user's models"] = user_bytes_per_param * total_params
    processes = len(params) * (engines_per_agent + (0 if colocated else 1))
    parts["processes"] = processes * PROCESS_BYTES + DRIVER_BYTES
    return Estimate(sum(parts.values()), parts)


def gpu_estimate(largest_params: int, *, reference: bool) -> int:
    """Bytes one learner needs on its GPU: weights, AdamW, activations, a reference copy."""
    per_param = 12 * (1 + ACTIVATION_FRACTION) + (4 if reference else 0)
    return int(per_param * largest_params)


def available_bytes() -> int | None:
    """Memory available to a new process on this machine (Linux MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def advice(colocated: bool, engine_bytes_per_param: int, engines_per_agent: int,
           reference: bool, checkpointing_saves: int = 0) -> list[str]:
    """The settings that lower the estimate, in the order they help most
    (`checkpointing_saves`: the bytes gradient_checkpointing=True would take off; 0: none)."""
    out = []
    if engine_bytes_per_param > 2:
        out.append("engine_dtype='bfloat16' (engine weights 2 bytes per parameter instead "
                   f"of {engine_bytes_per_param})")
    if checkpointing_saves > 0:
        out.append(f"gradient_checkpointing=True (about {checkpointing_saves / GB:.1f} GB less "
                   f"in an update, the same values, one more forward of compute)")
    if engines_per_agent > 1:
        out.append(f"rollout_workers_per_agent=1 (now {engines_per_agent}: one engine copy of "
                   f"each model per worker)")
    if not colocated:
        out.append("colocate=True (one process per agent instead of two)")
    if reference:
        out.append("reference_kl_enabled=False (no reference copy of each model)")
    out.append("fewer or smaller agents, or a machine with more memory")
    return out


def check_fits(need: Estimate, available: int | None, *, num_agents: int, params: list[int],
               tips: list[str]) -> None:
    """Refuse, before anything starts, a run whose estimate exceeds the available memory."""
    if available is None or need.total <= available:
        return
    parts = ", ".join(f"{name} {size / GB:.1f}" for name, size in need.parts.items())
    raise MemoryError(
        f"This run needs about {need.total / GB:.1f} GB of memory at its fullest (an update) "
        f"and this machine has {available / GB:.1f} GB available: {num_agents} agent(s) of "
        f"{max(params) / 1e6:.0f}M parameters ({parts} GB). Settings that help: "
        f"{'; '.join(tips)}. MAGRPOConfig(memory_check=False) skips this estimate.")


def check_gpu_fits(need: int, device_bytes: int, share: float) -> None:
    """Refuse a learner that will not fit its GPU (`share`: the part the engine leaves it)."""
    have = device_bytes * share
    if need > have:
        raise MemoryError(
            f"A learner needs about {need / GB:.1f} GB of GPU memory (fp32 weights, AdamW "
            f"and activations) and its GPU leaves it {have / GB:.1f} GB. Settings that help: "
            f"a lower gpu_memory_utilization when the engine shares the GPU, learners on "
            f"their own GPUs (single_gpu=False), or smaller agents. "
            f"MAGRPOConfig(memory_check=False) skips this estimate.")




def preflight(trainer: object, plan: dict, folders: list[str], settings: dict,
              checkpointing: bool = False) -> None:
    """The check a run makes on the machine it starts from, before any actor starts:
    on CPU against MemAvailable when this process started the Ray (everything lives here),
    on a GPU against the device's memory when the learner has one here. `checkpointing`:
    the run ends with a checkpoint of its final weights, which the user's models then map
    (`Session.pull_weights`) instead of taking new memory."""
    args = trainer.args
    models = trainer._initial_models()
    params = [sum(p.numel() for p in m.parameters()) for m in models]
    trainable = [sum(p.numel() for p in m.parameters() if p.requires_grad) for m in models]
    reference = bool(getattr(args, "reference_kl_enabled", False))
    learner_gpu = plan["learner"].num_gpus > 0 or "host" in plan and plan["host"].num_gpus > 0
    engine_gpu = plan["rollout"].num_gpus > 0 or "host" in plan and plan["host"].num_gpus > 0
    dtype = settings["engine_kwargs"]["dtype"]
    if dtype == "auto":
        dtype = config_dtype(folders[0]) if Path(folders[0]).is_dir() else "float32"
    engine_bytes = DTYPE_BYTES.get(str(dtype).replace("torch.", ""), 4)
    colocated = "host" in plan
    engines = args.rollout_workers_per_agent
    if learner_gpu:
        import torch

        if torch.cuda.is_available():
            share = 1.0 - plan["gpu_memory_utilization"] if (args.single_gpu or engine_gpu
                                                              and colocated) else 1.0
            check_gpu_fits(gpu_estimate(max(params), reference=reference),
                           torch.cuda.get_device_properties(0).total_memory, share)
        return

    kw = settings["engine_kwargs"]
    kv = 0 if engine_gpu or not Path(folders[0]).is_dir() else \
        kw["kv_cache_memory_bytes"] or cpu_kv_cache_bytes(
        folders[0], kw["dtype"], kw["max_model_len"], kw["kv_cache_sequences"],
        kw["kv_cache_tokens"])
    user_bytes = 0 if checkpointing else max(p.element_size() for p in models[0].parameters())
    # The update's working memory from the run's mini-batch where its longest sequence is
    # known at start (single-turn runs) and the config gives the shape; else the share.
    longest = kw["kv_cache_tokens"] or longest_sequence(trainer)
    activations, saves = None, 0
    if longest and all(hasattr(m.config, f) for m in models for f in SHAPE_FIELDS):
        tokens = args.train_batch_size * args.num_generations * longest
        activations = [update_activation_bytes(m.config, tokens, args.gradient_checkpointing)
                       for m in models]
        saves = sum(activations) - sum(update_activation_bytes(m.config, tokens, True)
                                       for m in models)
    need = estimate(params, colocated=colocated, engines_per_agent=engines,
                    engine_bytes_per_param=engine_bytes, reference=reference,
                    kv_cache_bytes=kv, engines_on_gpu=engine_gpu,
                    user_bytes_per_param=user_bytes, activation_bytes=activations,
                    trainable=trainable, engineless=[
                        a for a, leader in enumerate(settings.get("engine_leaders") or [])
                        if leader != a])
    check_fits(need, available_bytes(), num_agents=len(params), params=params,
               tips=advice(colocated, engine_bytes, engines, reference, saves))
