"""LoRA agents (the `peft` library): which agents train an adapter on a frozen base, their
adapters built reproducibly, and the two halves of a LoRA agent's model folder.

An agent is a LoRA agent when the trainer is given `peft_config=LoraConfig(...)` (TRL's
convention) or when the agent is handed over as a `peft.PeftModel`. Only its adapter is
trained, pushed to the engines, checkpointed and handed back; the base is loaded once per
process from the model folder the actors start from (`save_lora_folder`). `peft` is imported
only where a LoRA agent exists.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

from comlrl.magrpo import derive_seed

ADAPTER_FOLDER = "adapter"
"""The subfolder of a LoRA agent's model folder that holds its adapter (PEFT's format)."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
RESUME_FIELDS = ("peft_type", "r", "lora_alpha", "target_modules", "lora_dropout", "bias",
                 "use_rslora", "use_dora", "modules_to_save", "layers_to_transform",
                 "rank_pattern", "alpha_pattern", "init_lora_weights")
"""The adapter settings a resume must not change (fingerprinted as `peft_config.<field>`)."""


def is_peft_model(model: Any) -> bool:
    """Whether `model` is a `peft.PeftModel` (duck-typed: no peft import for plain models)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model") \
        and type(model).__module__.startswith("peft")


def check_peft_config(peft_config: Any) -> None:
    """Refuse what this runtime does not train: anything but LoRA, a second adapter per
    agent, or `modules_to_save` (full copies of modules the adapter would also train)."""
    if peft_config is None:
        return
    kind = str(getattr(getattr(peft_config, "peft_type", None), "value",
                       getattr(peft_config, "peft_type", None)))
    if kind != "LORA":
        raise ValueError(f"peft_config must be a peft.LoraConfig (got "
                         f"{type(peft_config).__name__}, peft_type {kind!r}); only LoRA "
                         f"adapters are trained here.")
    if getattr(peft_config, "modules_to_save", None):
        raise ValueError(f"peft_config.modules_to_save={peft_config.modules_to_save!r} is not "
                         f"supported: only LoRA weights are trained and pushed; set it to None.")
    if getattr(peft_config, "use_dora", False):
        raise ValueError("peft_config.use_dora=True is not supported (vLLM serves no DoRA "
                         "adapters); set use_dora=False.")


def adapter_config(model: Any) -> Any:
    """The one LoRA config of a PeftModel (refused if it holds several adapters)."""
    configs = dict(model.peft_config)
    if len(configs) != 1:
        raise ValueError(f"a PeftModel agent must hold one adapter (it holds "
                         f"{sorted(configs)}); merge or delete the others first.")
    config = next(iter(configs.values()))
    check_peft_config(config)
    return config


def make_lora_agents(models: list, peft_config: Any, seed: int) -> list:
    """Every model that is not already a PeftModel wrapped with its own copy of
    `peft_config` (`peft.get_peft_model`, which injects the adapter into the model in
    place). The adapter's random init draws from a generator seeded by (seed, agent), so
    a resumed run rebuilds the very adapters its checkpoint's run started from."""
    if peft_config is None:
        for model in models:
            if is_peft_model(model):
                adapter_config(model)
        return models
    import torch
    from peft import get_peft_model

    out = []
    for agent, model in enumerate(models):
        if is_peft_model(model):
            adapter_config(model)
            out.append(model)
            continue
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(seed, "lora", agent))
            out.append(get_peft_model(model, copy.deepcopy(peft_config)))
    return out


def resume_settings(models: list) -> dict | None:
    """{field: [value per agent, None for a full-weight agent]} of RESUME_FIELDS, or None
    when no agent is a LoRA agent (a full-weight run's fingerprints carry no such key)."""
    configs = [adapter_config(m) if is_peft_model(m) else None for m in models]
    if not any(configs):
        return None

    return {name: [None if c is None else _plain(getattr(c, name, None)) for c in configs]
            for name in RESUME_FIELDS}


def _plain(value: Any) -> Any:
    """A config value as JSON writes it the same in every process (a set: sorted)."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return getattr(value, "value", value)


def base_state_dict(model: Any) -> dict:
    """A PeftModel's base weights under the base model's own names (what `from_pretrained`
    loads): peft's `.base_layer` wrappers unwrapped, the adapter's weights left out."""
    out = {}
    for name, tensor in model.get_base_model().state_dict().items():
        if ".lora_" in name:
            continue
        out[name.replace(".base_layer.", ".")] = tensor
    return out


def adapter_state_dict(model: Any) -> dict:
    """The adapter's weights under PEFT's saved names (`adapter_model.safetensors`)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}


def load_adapter_state(model: Any, state: dict, what: str) -> None:
    """Load `state` (adapter_state_dict's names) into a PeftModel's adapter; refuse one whose
    names or shapes are not the adapter's (a different rank or target modules)."""
    from peft import set_peft_model_state_dict

    mine = adapter_state_dict(model)
    if {k: tuple(v.shape) for k, v in mine.items()} != \
            {k: tuple(v.shape) for k, v in state.items()}:
        other = sorted(set(state) ^ set(mine))[:3] or [
            k for k in mine if tuple(mine[k].shape) != tuple(state[k].shape)][:3]
        raise ValueError(f"{what}: the adapter weights do not match this agent's adapter "
                         f"(e.g. {other}): a different rank or target modules.")
    set_peft_model_state_dict(model, state)


def save_lora_folder(model: Any, folder: str | Path,
                     base_from: str | Path | None = None) -> None:
    """A LoRA agent's model folder: its base as a `from_pretrained` folder (config and
    weights) plus its adapter in ADAPTER_FOLDER, in PEFT's format. `base_from`: a folder
    of an agent with the very same base weights, whose files are hard-linked instead."""
    folder = Path(folder)
    base = model.get_base_model()
    if base_from is None:
        base.save_pretrained(folder, state_dict=base_state_dict(model), safe_serialization=True)
    else:
        folder.mkdir(parents=True, exist_ok=True)
        for f in Path(base_from).iterdir():
            if f.is_file():
                os.link(f, folder / f.name)
    model.save_pretrained(folder / ADAPTER_FOLDER, safe_serialization=True)
    write_adapter_config(adapter_config(model), folder / ADAPTER_FOLDER)


def write_adapter_config(config: Any, folder: str | Path) -> None:
    """`config` as PEFT's adapter_config.json, with the same bytes in every process: peft
    keeps `target_modules` as a set, which it writes in the process's hash order (so a
    resumed run's fingerprint of the very same adapter would differ)."""
    fields = {k: _plain(v) for k, v in config.to_dict().items()}
    (Path(folder) / ADAPTER_CONFIG).write_text(json.dumps(fields, indent=2, sort_keys=True,
                                                          default=str) + "\n")


def adapter_folder(model_folder: str | Path) -> Path | None:
    """The adapter subfolder of a model folder, if it is a LoRA agent's."""
    path = Path(model_folder) / ADAPTER_FOLDER
    return path if (path / ADAPTER_CONFIG).is_file() else None


def adapter_rank(folder: str | Path) -> int:
    """The largest rank an adapter folder's config uses (its `r` and any `rank_pattern`)."""
    cfg = json.loads((Path(folder) / ADAPTER_CONFIG).read_text())
    return max([int(cfg.get("r") or 8), *map(int, (cfg.get("rank_pattern") or {}).values())])
