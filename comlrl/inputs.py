"""The user's inputs, checked and normalised: datasets, formatters, tokenizers.

The trainer calls these at construction, so bad input fails before anything starts, with an
error that names the argument and the fix.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence


def dataset_rows(dataset: Any, name: str) -> list[dict] | None:
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


def build_formatters(formatters: Any, num_agents: int) -> list[Callable]:
    """One formatter per agent, each callable as f(row, external_prompts=None) -> str."""
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


def model_name_of(source: Any) -> str | None:
    """A model's name as comlrl reports it (`trainer.model_name`): a name stays a name; a
    model gives its config's `_name_or_path`, else its `model_type`, else its class name."""
    if source is None or isinstance(source, str):
        return source
    config = getattr(source, "config", None)
    name = getattr(config, "_name_or_path", None) or getattr(config, "model_type", None)
    return str(name) if name else type(source).__name__


def resolve_agent_sources(agent_model: Any, agents: Any, num_agents: int) -> tuple[list, Any]:
    """One model source (a name/path, or a loaded model) per agent, and `model_name`.

    comlrl 1.4.3's rules: `agents` alone sets the agent count; with `agent_model` too it must
    be a list of `num_agents` names equal to `agent_model`."""
    def is_list(value: Any) -> bool:
        return isinstance(value, Sequence) and not isinstance(value, (str, bytes))

    if agent_model is not None and agents is not None:
        if not is_list(agents):
            raise ValueError(f"Cannot provide both agent_model and agents unless agents is a "
                             f"list of num_agents ({num_agents}) model names.")
        if len(agents) != num_agents:
            raise ValueError(f"agents length ({len(agents)}) must match num_agents "
                             f"({num_agents}).")
        names = [model_name_of(a) for a in agents]
        if any(n != model_name_of(agent_model) for n in names):
            raise ValueError(f"agent_model and agents conflict: {model_name_of(agent_model)} "
                             f"!= {names}. Pass one of them.")
    if agents is not None:
        if not is_list(agents) or not agents:
            raise ValueError("agents must be a non-empty sequence (models or model names).")
        sources = list(agents)
    else:
        if isinstance(num_agents, bool) or not isinstance(num_agents, int) or num_agents < 1:
            raise ValueError(f"num_agents must be >= 1 (got {num_agents!r}).")
        sources = [agent_model] * num_agents
    if any(src is None for src in sources):
        raise ValueError("agents entries must be non-null.")
    if len({isinstance(src, str) for src in sources}) > 1:
        raise ValueError("agents mixes model names and model objects; pass all names (loaded "
                         "for you) or all models.")
    return sources, model_name_of(sources[0])


def resolve_tokenizers(tokenizer: Any, sources: list, model_config: dict) -> list:
    """One tokenizer per agent, each able to end (eos) and pad a completion.

    As in comlrl 1.4.3: without `tokenizer`, agents given by name get their own tokenizers
    (one shared tokenizer when every agent has the same name); a tokenizer without a pad
    token pads with its eos token."""
    num_agents = len(sources)
    if tokenizer is None:
        if not all(isinstance(src, str) for src in sources):
            raise ValueError("Tokenizer(s) must be provided when agents are model objects: "
                             "pass tokenizer=AutoTokenizer.from_pretrained(model_name).")
        from transformers import AutoTokenizer

        loaded = {name: AutoTokenizer.from_pretrained(name) for name in dict.fromkeys(sources)}
        tokenizer = [loaded[name] for name in sources]
    toks = list(tokenizer) if isinstance(tokenizer, (list, tuple)) else [tokenizer] * num_agents
    if len(toks) != num_agents:
        raise ValueError(f"tokenizers length must match agents: got {len(toks)} tokenizers for "
                         f"{num_agents} agents; pass one tokenizer or one per agent.")
    for i, tok in enumerate(toks):
        for k, v in model_config.get("special_tokens", {}).items():
            setattr(tok, k, v)
        if tok.eos_token_id is None:
            raise ValueError(f"tokenizer {i} has no eos_token: set tokenizer.eos_token (e.g. "
                             f"'<|endoftext|>'); completions must be able to end.")
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
    return toks
