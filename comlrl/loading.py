"""Loading a Hugging Face causal LM, one load at a time per process.

transformers' `from_pretrained` swaps process-wide state while it loads: it replaces
`PreTrainedModel.tie_weights` and torch's init functions on the class and module, and sets
torch's default dtype, then puts back what it found. Two loads in threads of one process
overlap those swaps, and the second puts back the first one's stand-ins: from then on every
model in the process loads with an untied head and skips its init. So every load here takes
`_LOAD_LOCK`."""

from __future__ import annotations

import threading
from typing import Any

_LOAD_LOCK = threading.RLock()


def load_kwargs(model_config: dict | None) -> dict:
    """`from_pretrained` keywords from comlrl's `model_config`: without `special_tokens`
    (the tokenizer's), and a dtype given by name (`"bfloat16"`) as the torch dtype."""
    kwargs = {k: v for k, v in (model_config or {}).items() if k != "special_tokens"}
    if isinstance(kwargs.get("dtype"), str) and kwargs["dtype"] != "auto":
        import torch

        kwargs["dtype"] = getattr(torch, kwargs["dtype"])
    return kwargs


def load_causal_lm(source: Any, **kwargs: Any) -> Any:
    """`AutoModelForCausalLM.from_pretrained(source, **kwargs)`, serialized in this process."""
    from transformers import AutoModelForCausalLM

    with _LOAD_LOCK:
        return AutoModelForCausalLM.from_pretrained(source, **kwargs)


def load_once(owner: Any, attribute: str, sources: list, model_config: dict | None,
              prepare: Any = None) -> list:
    """`owner.<attribute>`, loading it from `sources` first if it is None (and passing the
    loaded list through `prepare`, e.g. into LoRA agents). Callers in several threads get
    the same models: the check and the load happen under the lock, so no model is loaded
    twice (two copies of every weight in memory)."""
    with _LOAD_LOCK:
        if getattr(owner, attribute) is None:
            kwargs = load_kwargs(model_config)
            models = [load_causal_lm(s, **kwargs) for s in sources]
            setattr(owner, attribute, prepare(models) if prepare else models)
        return getattr(owner, attribute)
