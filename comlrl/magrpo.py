"""The MAGRPO math: joint actions, returns, advantages, seeds and the loss (`rewards.py` calls
the reward function).

Pure functions over lists and tensors. Importing this module pulls in neither vLLM nor Ray, so
everything here is unit-tested on its own (tests/test_magrpo_math.py).
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any, Sequence

# ---------------------------------------------------------------- joint actions and returns


def joint_actions(num_agents: int, k: int, cross: bool) -> list[tuple[int, ...]]:
    """Completion index of every agent, per joint action.

    Aligned: joint action j is completion j of every agent (K of them). Cross: the Cartesian
    product of the agents' completions (K^N), in `itertools.product` order like comlrl.
    """
    if cross and num_agents > 1:
        return list(itertools.product(range(k), repeat=num_agents))
    return [(j,) * num_agents for j in range(k)]


def per_agent_returns(
    joint_returns: Sequence[float], combos: Sequence[tuple[int, ...]], agent: int, k: int,
    cross: bool,
) -> list[float]:
    """Return of each of an agent's K completions.

    Aligned: completion j gets joint return j. Cross: the sum of the returns of every joint
    action the completion is part of (comlrl's rule: a sum, not a mean).
    """
    if not cross:
        return [float(r) for r in joint_returns]
    sums = [0.0] * k
    for ret, combo in zip(joint_returns, combos):
        sums[combo[agent]] += float(ret)
    return sums


# ---------------------------------------------------------------- advantages


def compute_advantages(returns: Sequence[float], mode: str, normalize: bool) -> list[float]:
    """Group-relative advantages of one (prompt, turn node, agent) group.

    mean: r - mean(r); raw: r; max: r - max(r); rloo: r_i - mean of the others. Then, if
    `normalize`, z-score with the population std clamped at 1e-6 (comlrl's rule).
    """
    import torch

    r = torch.tensor(list(returns), dtype=torch.float32)
    if mode == "mean":
        adv = r - r.mean()
    elif mode == "raw":
        adv = r.clone()
    elif mode == "max":
        adv = r - r.max()
    elif mode == "rloo":
        g = r.numel()
        adv = r - r.mean() if g <= 1 else (r * g - r.sum()) / (g - 1)
    else:
        raise ValueError(f"advantage_mode must be one of: mean, raw, max, rloo (got {mode!r}).")
    if normalize and adv.numel() > 1:
        adv = (adv - adv.mean()) / adv.std(unbiased=False).clamp(min=1e-6)
    return adv.tolist()


# ---------------------------------------------------------------- seeds


def derive_seed(*parts: Any) -> int:
    """A 31-bit seed from the run seed and counters (never from process history).

    Hashing the parts keeps seeds of different (epoch, prompt, agent, turn) far apart, so a
    request with n samples (vLLM uses seed+j for child j) never collides with its neighbours.
    """
    digest = hashlib.sha256(repr(tuple(parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x3FFFFFFF


# ---------------------------------------------------------------- loss


def trim_at_eos(token_ids: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    """Completion tokens up to and including the first EOS: nothing after it is trained on."""
    out = []
    for t in token_ids:
        out.append(int(t))
        if t in eos_ids:
            break
    return out


def pad_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int):
    """Right-padded [prompt + completion] rows, attention mask and completion-token mask.

    Returns (input_ids, attention_mask, target_mask) as tensors; target_mask[b, t] is 1 where
    token t of row b is a completion token (so logits at t-1 predict it). Rows are trimmed to
    the longest real row: no column is pure padding.
    """
    import torch

    rows = [list(p) + list(c) for p, c in zip(prompts, completions)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    target = torch.zeros((len(rows), width), dtype=torch.float32)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        n = len(p) + len(c)
        ids[b, :n] = torch.tensor(rows[b], dtype=torch.long)
        attn[b, :n] = 1
        target[b, len(p):n] = 1.0
    return ids, attn, target


def token_logprobs(logits, input_ids):
    """Log-prob of each token given the tokens before it; position 0 gets 0.

    logits: [B, T, V] from a causal LM over input_ids [B, T]. Returns [B, T].
    """
    import torch

    # Over every position, then the last dropped: a slice before log_softmax would copy the
    # [B, T, V] logits, and its backward pad another, each as large as the vocabulary makes
    # them (151936 ids: the head's part of an update). Row by row the same bits either way.
    logp = torch.log_softmax(logits.float(), dim=-1)
    following = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)
    picked = logp.gather(-1, following.unsqueeze(-1)).squeeze(-1)[:, :-1]
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


def policy_loss(tok_logp, target_mask, advantages, group_sizes: Sequence[int],
                aggregation: str = "sequence"):
    """MAGRPO policy-gradient loss of a mini-batch of groups.

    Per completion: minus (sum of its token log-probs) times its advantage ('sequence', comlrl),
    or minus the mean token log-prob times the advantage ('token_mean'). Averaged within each
    group, then over groups, which is comlrl's per-sample mean scaled by 1/len(batch).
    """
    import torch

    seq = (tok_logp * target_mask).sum(dim=1)
    if aggregation == "token_mean":
        seq = seq / target_mask.sum(dim=1).clamp(min=1)
    per_completion = -seq * advantages
    losses, start = [], 0
    for g in group_sizes:
        losses.append(per_completion[start:start + g].mean())
        start += g
    return torch.stack(losses).mean()
