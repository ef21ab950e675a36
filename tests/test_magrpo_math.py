"""The MAGRPO math against values worked out by hand (no vLLM, no Ray)."""

from __future__ import annotations

import math
import sys

import pytest

from comlrl import magrpo, rewards


def test_math_module_imports_neither_vllm_nor_ray():
    import subprocess

    code = ("import sys, comlrl.magrpo, comlrl.config, comlrl.rollout, comlrl.checkpoint; "
            "bad = [m for m in ('vllm', 'ray') if m in sys.modules]; print(bad); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_joint_actions_aligned_and_cross():
    assert magrpo.joint_actions(2, 3, cross=False) == [(0, 0), (1, 1), (2, 2)]
    cross = magrpo.joint_actions(2, 3, cross=True)
    assert len(cross) == 9 and cross[:4] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert len(magrpo.joint_actions(3, 2, cross=True)) == 8


def test_cross_returns_are_sums_over_joint_actions():
    combos = magrpo.joint_actions(2, 2, cross=True)       # (0,0) (0,1) (1,0) (1,1)
    joint = [1.0, 2.0, 3.0, 4.0]
    assert magrpo.per_agent_returns(joint, combos, 0, 2, cross=True) == [3.0, 7.0]
    assert magrpo.per_agent_returns(joint, combos, 1, 2, cross=True) == [4.0, 6.0]
    assert magrpo.per_agent_returns([1.0, 2.0], [(0, 0), (1, 1)], 1, 2, cross=False) == [1.0, 2.0]


@pytest.mark.parametrize("mode,expected", [
    ("mean", [-1.5, -0.5, 0.5, 1.5]),
    ("raw", [1.0, 2.0, 3.0, 4.0]),
    ("max", [-3.0, -2.0, -1.0, 0.0]),
    # rloo: r_i - mean(others): 1 - 3, 2 - 8/3, 3 - 7/3, 4 - 2
    ("rloo", [-2.0, -2 / 3, 2 / 3, 2.0]),
])
def test_advantages_by_hand(mode, expected):
    got = magrpo.compute_advantages([1.0, 2.0, 3.0, 4.0], mode, normalize=False)
    assert got == pytest.approx(expected, abs=1e-6)


def test_advantage_normalization_uses_population_std():
    # mean-baseline of [1,2,3,4] is [-1.5,-.5,.5,1.5]; population std = sqrt(1.25)
    got = magrpo.compute_advantages([1.0, 2.0, 3.0, 4.0], "mean", normalize=True)
    s = math.sqrt(1.25)
    assert got == pytest.approx([-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s], abs=1e-6)
    # Equal returns: std clamps at 1e-6 instead of dividing by zero.
    assert magrpo.compute_advantages([2.0, 2.0], "mean", normalize=True) == [0.0, 0.0]
    # 'raw' normalised is z-scored too: [1, 3] -> [-1, 1]
    assert magrpo.compute_advantages([1.0, 3.0], "raw", normalize=True) == pytest.approx([-1, 1])


def _reward(c1, c2):
    return [float(len(a) + len(b)) for a, b in zip(c1, c2)]


def test_reward_call_passes_one_list_per_agent_and_keywords():
    seen = {}

    def reward(c1, c2, prompts=None, batch_items=None):
        seen.update(c1=c1, c2=c2, prompts=prompts, batch_items=batch_items)
        return [1.0] * len(c1)

    style = rewards.reward_call_style(reward, 2)
    out = rewards.call_reward(reward, [["a", "b"], ["c", "d"]], prompts=["p"],
                              batch_items=[{"prompt": "p"}], style=style,
                              reward_processor=lambda r: r * 2)
    assert out == [2.0, 2.0]
    assert seen == {"c1": ["a", "b"], "c2": ["c", "d"], "prompts": ["p"],
                    "batch_items": [{"prompt": "p"}]}
    plain = rewards.reward_call_style(_reward, 2)
    assert plain == {"prompts": False, "batch_items": False}
    assert rewards.call_reward(_reward, [["ab"], ["c"]], prompts=["p"], batch_items=[{}],
                               style=plain) == [3.0]
    kw = rewards.reward_call_style(lambda *cs, **kw: [0.0], 2)
    assert kw == {"prompts": True, "batch_items": True}


@pytest.mark.parametrize("func,match", [
    (lambda c1, c2: [1.0], "returned 1 values for 2 joint actions"),
    (lambda c1, c2: [1.0, float("nan")], "not finite"),
    (lambda c1, c2: [1.0, "high"], "non-number at position 1"),
    (lambda c1, c2: 1.0, "must return a list of 2 floats"),
    (lambda c1, c2: 1 / 0, "reward_func raised ZeroDivisionError"),
])
def test_bad_reward_results_raise_with_the_completions(func, match):
    style = rewards.reward_call_style(func, 2)
    with pytest.raises(ValueError, match=match) as info:
        rewards.call_reward(func, [["first-a", "first-b"], ["second-a", "second-b"]],
                            prompts=["p"], batch_items=[{}], style=style)
    assert "'first-a'" in str(info.value) and "'second-b'" in str(info.value)


def test_reward_signature_that_fits_nothing_is_refused():
    with pytest.raises(ValueError, match="one list of completions per agent"):
        rewards.reward_call_style(lambda: [0.0], 2)   # r(all_lists) is a comlrl form
    with pytest.raises(ValueError, match="must be a callable"):
        rewards.reward_call_style("not a function", 2)


def test_derived_seeds_depend_on_counters_only():
    a = magrpo.derive_seed(42, "train", 0, 3, (), 1)
    assert a == magrpo.derive_seed(42, "train", 0, 3, (), 1)
    others = {magrpo.derive_seed(42, "train", e, p, (), ag)
              for e in range(3) for p in range(8) for ag in range(2)}
    assert len(others) == 48 and all(0 <= s < 2 ** 30 for s in others)
    assert magrpo.derive_seed(43, "train", 0, 3, (), 1) != a


def test_trim_at_eos_keeps_the_eos_and_drops_what_follows():
    assert magrpo.trim_at_eos([5, 6, 0, 0, 7], {0}) == [5, 6, 0]
    assert magrpo.trim_at_eos([5, 6], {0}) == [5, 6]


def _reference_loss(model, prompt_ids, completions, advantages):
    """Plain per-completion computation: one forward each, like comlrl (but EOS-trimmed)."""
    import torch

    total = 0.0
    for comp, adv in zip(completions, advantages):
        ids = torch.tensor([prompt_ids + comp])
        logp = model(ids).logits[0, :-1].float().log_softmax(-1)
        tok = logp[len(prompt_ids) - 1:].gather(-1, torch.tensor(comp)[:, None]).sum()
        total = total - tok * adv
    return total / len(completions)


def test_batched_loss_matches_per_completion_reference_and_ignores_tokens_after_eos(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    eos = model.config.eos_token_id
    groups = [
        ([11, 12, 13], [[40, 41, eos], [42, 43, 44, 45, 46], [47, eos]], [0.5, -1.0, 0.5]),
        ([21, 22], [[50, eos], [51, 52, 53, eos]], [1.0, -1.0]),
    ]
    prompts = [p for p, cs, _ in groups for _ in cs]
    comps = [c for _, cs, _ in groups for c in cs]
    adv = torch.tensor([a for _, _, advs in groups for a in advs])
    ids, attn, target = magrpo.pad_batch(prompts, comps, pad_id=eos)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits
        batched = magrpo.policy_loss(magrpo.token_logprobs(logits, ids), target, adv,
                                     [len(cs) for _, cs, _ in groups])
        reference = sum(_reference_loss(model, p, cs, a) for p, cs, a in groups) / len(groups)
    assert abs(batched.item() - reference.item()) < 1e-6

    # Tokens after EOS (as an untrimmed engine output would have) change nothing once trimmed.
    padded = [c + [77, 78] if c[-1] == eos else c for c in comps]
    trimmed = [magrpo.trim_at_eos(c, {eos}) for c in padded]
    assert trimmed == comps
    # ...and the mask never covers the padding columns of shorter rows.
    assert target.sum().item() == sum(len(c) for c in comps)
    assert target[0, 3 + 3:].sum().item() == 0.0


def test_token_mean_aggregation_divides_by_length():
    import torch

    tok_logp = torch.tensor([[0.0, -1.0, -1.0], [0.0, -2.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    seq = magrpo.policy_loss(tok_logp, mask, adv, [2])
    assert seq.item() == pytest.approx(((2.0) + (-2.0)) / 2)
    mean = magrpo.policy_loss(tok_logp, mask, adv, [2], aggregation="token_mean")
    assert mean.item() == pytest.approx((1.0 - 2.0) / 2)
