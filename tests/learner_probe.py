"""Test helper: what a learner's current weights say about completions, read from outside.

Tests ask the learner actor for its weights through its public surface (`get_weights`) and
score completions here with the same math the learner trains with, so the learner carries no
methods that only tests call.
"""

from __future__ import annotations


def sequence_logprobs(learner, model_path: str, prompt_ids: list[int],
                      completions: list[list[int]]) -> list[list[float]]:
    """Per-token log-probs of each completion under `learner`'s current weights (no grad)."""
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from comlrl.magrpo import pad_batch, token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.load_state_dict(ray.get(learner.get_weights.remote()))
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    ids, attn, _ = pad_batch([prompt_ids] * len(completions), completions, pad)
    with torch.no_grad():
        lp = token_logprobs(model(input_ids=ids, attention_mask=attn).logits, ids)
    start = len(prompt_ids)
    return [lp[b, start:start + len(c)].tolist() for b, c in enumerate(completions)]
