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


def test_gradient_checkpointing_updates_bit_for_bit_like_the_plain_learner(tiny_model):
    """`gradient_checkpointing=True` replays each decoder layer's forward in backward instead
    of keeping its activations. Two updates of two mini-batches each, with and without it:
    every weight and both AdamW moments equal bit for bit, the same losses. (comlrl 1.4.3 has
    no such setting: `MAGRPOConfig(gradient_checkpointing=True)` raises its TypeError
    "unexpected keyword argument".)"""
    import torch

    from workers.roles.learner import Learner

    plain = Learner(0, tiny_model, learning_rate=1e-2, train_batch_size=1, device="cpu")
    replayed = Learner(0, tiny_model, learning_rate=1e-2, train_batch_size=1, device="cpu",
                       gradient_checkpointing=True)
    assert replayed.model.is_gradient_checkpointing and not plain.model.is_gradient_checkpointing
    for seed in (0, 1):
        a = plain.update([dict(g) for g in _groups()], shuffle_seed=seed)
        b = replayed.update([dict(g) for g in _groups()], shuffle_seed=seed)
        assert a["loss"] == b["loss"]
    theirs, ours = plain.model.state_dict(), replayed.model.state_dict()
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name
    for index, state in plain.optimizer.state_dict()["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(replayed.optimizer.state_dict()["state"][index][key],
                               state[key]), (index, key)


def test_an_updates_peak_memory_is_what_the_estimate_says_and_checkpointing_cuts_it(
        tmp_path):
    """One update of a 16-layer model on an 8 x 256-token mini-batch, each in a fresh process
    (tests/update_memory_script.py samples RssAnon above its value before the update, with
    the allocator settings an actor has, workers/engines.ENGINE_ENV): the
    memory check's `update_activation_bytes` is within 20% of what was measured, with and
    without checkpointing; checkpointing takes the peak to under half; the weights after
    the update are the same. Measured here over six runs: 497-523 MB (estimate 516)
    and 190-218 MB (estimate 203)."""
    import json
    import os
    import subprocess
    import sys

    from transformers import AutoConfig

    from comlrl.tiny_model import build_tiny_model
    from tests.conftest import ROOT
    from workers.driver.memory import update_activation_bytes
    from workers.engines import ENGINE_ENV

    model = build_tiny_model(tmp_path / "deep", hidden_size=128, num_layers=16, num_heads=4,
                             num_kv_heads=2, intermediate_size=512)
    config = AutoConfig.from_pretrained(model)
    runs = {}
    for checkpointed in (False, True):
        proc = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "update_memory_script.py"), str(model),
             str(int(checkpointed))], capture_output=True, text=True, timeout=300,
            env={**os.environ, **ENGINE_ENV, "PYTHONPATH": str(ROOT)})  # as in an actor
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[checkpointed] = json.loads(proc.stdout.strip().splitlines()[-1])
        estimate = update_activation_bytes(config, runs[checkpointed]["tokens"], checkpointed)
        measured = runs[checkpointed]["peak_bytes"]
        assert 0.8 * estimate < measured < 1.2 * estimate, (checkpointed, measured, estimate)
    assert runs[True]["peak_bytes"] < 0.5 * runs[False]["peak_bytes"]
    assert runs[True]["loss"] == runs[False]["loss"]
    assert runs[True]["weights"] == runs[False]["weights"]
