"""comlrl 1.4.3 behaviours of the trainer that this runtime meets its own way: `train()`'s
generation keywords, the reference copies users read, and models vLLM's CPU attention
cannot run (head_dim < 32)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

from comlrl.loading import load_once

# What comlrl 1.4.3 passes by name to its generation helper itself: a train() keyword of
# the same name is given twice there (TypeError, "got multiple values for keyword argument").
_GIVEN_BY_COMLRL = ("agent", "batch_items", "agent_idx", "num_return_sequences",
                    "max_new_tokens", "prompts_override", "external_prompts")
# Generation options comlrl sets from its config; a keyword with the config's own value
# changes nothing, so it is accepted.
_FROM_CONFIG = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}
_FIXED = {"num_beams": 1, "return_dict_in_generate": True}

MIN_CPU_HEAD_DIM = 32
"""vLLM's CPU attention refuses smaller heads ("Unsupported CPU attention configuration")."""


def check_generation_kwargs(args: Any, kwargs: dict) -> None:
    """comlrl's `train(**kwargs)` hands the keywords to HF `generate` for every training
    rollout (`do_sample` is dropped). Here rollouts run on the engines, sampled as the
    config says: keywords that change nothing are accepted (none, `do_sample`, a sampling
    option equal to the config's), the rest refused before anything starts, with comlrl's
    error where comlrl fails too and the config field to use where it would sample
    differently."""
    given = {k: v for k, v in kwargs.items() if k != "do_sample"}
    twice = [k for k in given if k in _GIVEN_BY_COMLRL]
    if twice:
        raise TypeError(f"train() got multiple values for keyword argument {twice[0]!r} "
                        f"(comlrl 1.4.3 sets it itself; here MAGRPOConfig.{twice[0]} "
                        f"decides)." if twice[0] == "max_new_tokens" else
                        f"train() got multiple values for keyword argument {twice[0]!r}.")
    different = {}
    for key, value in given.items():
        if key in _FROM_CONFIG and value == getattr(args, _FROM_CONFIG[key]):
            continue
        if key in _FIXED and value == _FIXED[key]:
            continue
        different[key] = value
    if not different:
        return
    from transformers import GenerationConfig

    known = set(GenerationConfig().to_dict()) | {"streamer", "logits_processor",
                                                  "stopping_criteria", "assistant_model"}
    unknown = sorted(k for k in different if k not in known)
    if unknown:
        raise ValueError(f"Generation failed: The following `model_kwargs` are not used by "
                         f"the model: {unknown} (note: typos in the generate arguments will "
                         f"also show up in this list)")
    fields = ", ".join(f"{k}={v!r}" for k, v in different.items())
    config_side = [f"{_FROM_CONFIG[k]}=" for k in different if k in _FROM_CONFIG]
    hint = (f"set MAGRPOConfig({', '.join(config_side)}...) instead" if config_side
            else "they have no counterpart in MAGRPOConfig")
    raise ValueError(f"train({fields}): comlrl 1.4.3 passes these to Hugging Face generate; "
                     f"here rollouts run on the rollout engines, sampled as MAGRPOConfig "
                     f"says (temperature, top_p, top_k, max_new_tokens), so {hint}.")


def head_dim(config: Any) -> int | None:
    """Attention head size of a transformers config (None if it does not say)."""
    explicit = getattr(config, "head_dim", None)
    if isinstance(explicit, int) and explicit > 0:
        return explicit
    hidden = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def _model_config(source: Any) -> Any:
    if not isinstance(source, str):
        return getattr(source, "config", None)
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(source)
    except (OSError, ValueError):
        return None                           # checked where the model is loaded


def engine_for_head_dim(trainer: Any) -> None:
    """A model with heads smaller than vLLM's CPU attention takes (comlrl 1.4.3 trains it
    with HF generate) rolls out on the HF engine instead, said once at construction; vLLM
    on a GPU is left as configured."""
    args = trainer.args
    if args.rollout_engine != "vllm" or args.single_gpu or args.rollout_num_gpus > 0:
        return
    small = {}
    for i, source in enumerate(trainer.model_sources):
        size = head_dim(_model_config(source))
        if size is not None and size < MIN_CPU_HEAD_DIM:
            small[i] = size
    if not small:
        return
    args.rollout_engine = "hf"
    agents = ", ".join(f"agent {i}: head_dim={size}" for i, size in small.items())
    warnings.warn(f"vLLM's CPU attention needs head_dim >= {MIN_CPU_HEAD_DIM} ({agents}); "
                  f"these rollouts run on the Hugging Face engine (rollout_engine='hf'). "
                  f"Give the engines a GPU (rollout_num_gpus) to keep vLLM.", stacklevel=3)


def reference_copies(trainer: Any) -> list:
    """`trainer.reference_models`: built once. Models given by name load again from it (the
    initial weights whenever they are read); model objects are deep-copied, which the first
    `train()` does before it changes them."""
    if not trainer.args.reference_kl_enabled:
        return []
    if trainer._reference_models is None:
        sources = trainer.model_sources
        if all(isinstance(s, str) for s in sources):
            models = load_once(trainer, "_reference_models", sources, trainer.model_config)
        else:
            models = [copy.deepcopy(m) for m in trainer._initial_models()]
        for model in models:
            model.eval().requires_grad_(False)
        trainer._reference_models = models
    return trainer._reference_models
