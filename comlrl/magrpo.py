"""The MAGRPO math: joint actions, reward calls, returns, advantages, seeds and the loss.

Pure functions over lists and tensors. Importing this module pulls in neither vLLM nor Ray, so
everything here is unit-tested on its own (tests/test_magrpo_math.py).
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import math
from typing import Any, Callable, Sequence

# ---------------------------------------------------------------- joint actions and rewards


def joint_actions(num_agents: int, k: int, cross: bool) -> list[tuple[int, ...]]:
    """Completion index of every agent, per joint action.

    Aligned: joint action j is completion j of every agent (K of them). Cross: the Cartesian
    product of the agents' completions (K^N), in `itertools.product` order like comlrl.
    """
    if cross and num_agents > 1:
        return list(itertools.product(range(k), repeat=num_agents))
    return [(j,) * num_agents for j in range(k)]


def reward_call_style(reward_func: Callable, num_agents: int) -> dict:
    """How to call `reward_func`: with which keywords. Raises for a signature that fits nothing.

    Completions always go positionally, one list per agent. `prompts=` and `batch_items=` are
    passed by keyword when the function names them or takes **kwargs.
    """
    if not callable(reward_func):
        raise ValueError("reward_func must be a callable.")
    try:
        sig = inspect.signature(reward_func)
    except (TypeError, ValueError):
        return {"prompts": False, "batch_items": False}
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.name not in ("prompts", "batch_items")]
    required = [p for p in positional if p.default is p.empty]
    has_varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    has_varkw = any(p.kind == p.VAR_KEYWORD for p in params)
    if not has_varargs and (len(required) > num_agents or len(positional) < num_agents):
        names = ", ".join(p.name for p in positional) or "nothing"
        raise ValueError(
            f"reward_func must take one list of completions per agent ({num_agents} positional "
            f"arguments, or *args), plus optional prompts=/batch_items= keywords; its signature "
            f"{sig} takes {names}. Fix: def reward(completions1, ..., completions{num_agents}, "
            f"**kwargs)."
        )
    names = {p.name for p in params}
    return {"prompts": "prompts" in names or has_varkw,
            "batch_items": "batch_items" in names or has_varkw}


def call_reward(
    reward_func: Callable,
    completions_per_agent: Sequence[Sequence[str]],
    *,
    prompts: Sequence[str],
    batch_items: Sequence[dict],
    style: dict,
    reward_processor: Callable[[float], float] | None = None,
) -> list[float]:
    """Call `reward_func` once on whole lists (one per agent, each as long as the joint actions).

    Returns one finite float per joint action, after `reward_processor`. Any other result raises
    a ValueError that shows the completions it failed on, before any update uses it.
    """
    n = len(completions_per_agent[0])
    kwargs = {}
    if style.get("prompts"):
        kwargs["prompts"] = list(prompts)
    if style.get("batch_items"):
        kwargs["batch_items"] = list(batch_items)

    def shown() -> str:
        lines = []
        for a, comps in enumerate(completions_per_agent):
            lines.append(f"  agent {a}: " + ", ".join(repr(c[:60]) for c in comps[:4])
                         + (" ..." if len(comps) > 4 else ""))
        return "\n".join(lines)

    try:
        raw = reward_func(*[list(c) for c in completions_per_agent], **kwargs)
    except Exception as exc:
        raise ValueError(
            f"reward_func raised {type(exc).__name__}: {exc}\non these completions:\n{shown()}"
        ) from exc
    if hasattr(raw, "tolist"):
        raw = raw.tolist()
    if not isinstance(raw, (list, tuple)):
        raise ValueError(
            f"reward_func must return a list of {n} floats (one per joint action); it returned "
            f"{type(raw).__name__}. Completions:\n{shown()}"
        )
    if len(raw) != n:
        raise ValueError(
            f"reward_func returned {len(raw)} values for {n} joint actions; it must return one "
            f"float per joint action (one per position of the completion lists). "
            f"Completions:\n{shown()}"
        )
    rewards = []
    for i, r in enumerate(raw):
        if isinstance(r, bool) or not isinstance(r, (int, float)) and not hasattr(r, "__float__"):
            raise ValueError(
                f"reward_func returned a non-number at position {i}: {r!r} "
                f"(type {type(r).__name__}); return floats. Completions:\n{shown()}"
            )
        value = float(r)
        if reward_processor is not None:
            value = float(reward_processor(value))
        if not math.isfinite(value):
            raise ValueError(
                f"reward_func returned {value} (not finite) at position {i}"
                f"{' after reward_processor' if reward_processor else ''}; rewards must be finite "
                f"floats. Completions:\n{shown()}"
            )
        rewards.append(value)
    return rewards


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

    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
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
