"""The learner's memory levers compute what the plain way computes, bit for bit.

Unit tests of the Learner class (no Ray, no vLLM) on the tiny model.
"""

from __future__ import annotations

import random


def _groups() -> list[dict]:
    return [{"prompt_ids": [5, 6, 7], "completions": [[8, 9, 3], [10, 11], [12, 13, 14, 15]],
             "returns": [1.0, 0.0, 0.5], "turn": 0},
            {"prompt_ids": [20, 21], "completions": [[22], [23, 24, 25], [26, 27]],
             "returns": [0.2, 0.9, 0.4], "turn": 0}]


def test_adamw_stepped_in_backward_equals_one_step_after_backward(tiny_model):
    """`step_in_backward` runs AdamW per parameter while backward runs and drops each gradient.
    Two updates of two mini-batches each against the same loop written the plain way
    (`loss.backward(); optimizer.step()`): every weight and both AdamW moments are equal bit
    for bit, and no gradient is left after an update (the 4 bytes per parameter it saves)."""
    import torch
    from transformers import AutoModelForCausalLM

    from comlrl.magrpo import compute_advantages, pad_batch, policy_loss, token_logprobs
    from workers.roles.learner import Learner

    learner = Learner(0, tiny_model, learning_rate=1e-2, train_batch_size=1, device="cpu")
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01)
    for seed in (0, 1):
        learner.update([dict(g) for g in _groups()], shuffle_seed=seed)
        assert all(p.grad is None for p in learner.model.parameters())
        groups = _groups()
        order = [0, 1]
        random.Random(seed).shuffle(order)
        for i in order:
            g = groups[i]
            adv = torch.tensor(compute_advantages(g["returns"], "mean", True))
            ids, attn, target = pad_batch([g["prompt_ids"]] * 3, g["completions"],
                                          learner.pad_id)
            optimizer.zero_grad(set_to_none=True)
            logits = plain(input_ids=ids, attention_mask=attn, use_cache=False).logits
            loss = policy_loss(token_logprobs(logits, ids), target, adv, [3], "sequence")
            loss.backward()
            optimizer.step()
    mine = learner.model.state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).state_dict()
    for name, value in plain.state_dict().items():
        assert torch.equal(mine[name], value), name
    assert not torch.equal(mine["lm_head.weight"], initial["lm_head.weight"])  # they moved
    theirs = optimizer.state_dict()["state"]
    ours = learner.optimizer.state_dict()["state"]
    assert ours.keys() == theirs.keys()
    for index in theirs:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ours[index][key], theirs[index][key]), (index, key)
