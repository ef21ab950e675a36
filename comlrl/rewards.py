"""Reward calls: how a user's `reward_func` is called, and the checks of what it returns.

`reward_call_style` decides once, from the signature, which of comlrl 1.4.3's call forms a
reward function takes; `call_reward` calls it on whole completion lists and refuses a result of
the wrong type or length, a non-number or a non-finite value. The MAGRPO math is in `magrpo.py`.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable, Sequence

# How comlrl 1.4.3 hands a reward function its arguments (its reward adapter, decided from the
# signature): "agents" = one completion list per agent, positionally (the default);
# "prompts_first" = the prompts list, then the agents' lists; "joint" = one positional argument
# holding every agent's list; "probe" = no readable signature: try comlrl's fallbacks in order
# at the first call and keep the form that worked.
REWARD_FORMS = ("agents", "prompts_first", "joint", "probe")


def reward_call_style(reward_func: Callable, num_agents: int) -> dict:
    """How to call `reward_func`, decided once, the way comlrl 1.4.3's reward adapter decides.

    Returns {"prompts": bool, "batch_items": bool} (pass them by keyword) plus, when the
    positional form is not "agents", "positional": "prompts_first" | "joint" | "probe". comlrl
    counts the positional parameters P (prompts/batch_items included): with *args, the agents'
    lists; with one agent, the lists alone when P == 1, else (prompts, list); with N agents,
    (prompts, lists...) when P == N + 1, (every list as one argument) when P == 1, else the
    lists. prompts= goes by keyword when not passed positionally and the function names it or
    takes **kwargs; batch_items= when it names it or takes **kwargs. If that call cannot bind,
    comlrl calls with the agents' lists alone; a signature that fits neither is refused here.
    """
    if not callable(reward_func):
        raise ValueError("reward_func must be a callable.")
    try:
        sig = inspect.signature(reward_func)
    except (TypeError, ValueError):
        return {"prompts": False, "batch_items": False, "positional": "probe"}
    params = list(sig.parameters.values())
    n_positional = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    has_varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    has_varkw = any(p.kind == p.VAR_KEYWORD for p in params)
    if has_varargs:
        form = "agents"
    elif num_agents == 1:
        form = "agents" if n_positional == 1 else "prompts_first"
    elif n_positional == num_agents + 1:
        form = "prompts_first"
    elif n_positional == 1:
        form = "joint"
    else:
        form = "agents"
    style = {"prompts": form != "prompts_first" and ("prompts" in sig.parameters or has_varkw),
             "batch_items": "batch_items" in sig.parameters or has_varkw}
    if form != "agents":
        style["positional"] = form
    lists = [[""] for _ in range(num_agents)]
    if _binds(sig, _reward_args(style, lists, [""]), _reward_kwargs(style, [""], [{}])):
        return style
    plain = {"prompts": False, "batch_items": False}          # comlrl's retry: the lists alone
    if _binds(sig, lists, {}):
        return plain
    raise ValueError(
        f"reward_func must take one list of completions per agent ({num_agents} positional "
        f"arguments, or *args), plus optional prompts=/batch_items= keywords, or one of "
        f"comlrl's other forms: (prompts, completions1, ..., completions{num_agents}), or a "
        f"single argument holding every agent's list. Its signature {sig} binds none of them. "
        f"Fix: def reward(completions1, ..., completions{num_agents}, **kwargs)."
    )


def _binds(sig: inspect.Signature, args: list, kwargs: dict) -> bool:
    try:
        sig.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _reward_args(style: dict, lists: list, prompts: list) -> list:
    form = style.get("positional", "agents")
    if form == "prompts_first":
        return [prompts] + lists
    if form == "joint":
        return [lists]
    return lists


def _reward_kwargs(style: dict, prompts: list, batch_items: list) -> dict:
    kwargs = {}
    if style.get("prompts"):
        kwargs["prompts"] = prompts
    if style.get("batch_items"):
        kwargs["batch_items"] = batch_items
    return kwargs


def _probe_reward(reward_func: Callable, lists: list, batch_items: list, style: dict):
    """comlrl's order for a callable without a signature: (*lists, batch_items=...), then
    (*lists), then (lists). The first that does not raise TypeError is kept in `style`."""
    attempts = [({"prompts": False, "batch_items": True}, lambda: reward_func(
                    *lists, batch_items=batch_items)),
                ({"prompts": False, "batch_items": False}, lambda: reward_func(*lists)),
                ({"prompts": False, "batch_items": False, "positional": "joint"},
                 lambda: reward_func(lists))]
    for i, (found, attempt) in enumerate(attempts):
        try:
            raw = attempt()
        except TypeError:
            if i == len(attempts) - 1:
                raise
            continue
        style.clear()
        style.update(found)
        return raw


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

    `prompts` and `batch_items` go to the function as given (the caller aligns them with the
    completion lists, one entry per joint action, as comlrl does), in the form `style` says.
    Returns one finite float per joint action, after `reward_processor`. Any other result
    raises a ValueError that shows the completions it failed on, before any update uses it.
    """
    n = len(completions_per_agent[0])
    lists = [list(c) for c in completions_per_agent]

    def shown() -> str:
        lines = []
        for a, comps in enumerate(completions_per_agent):
            lines.append(f"  agent {a}: " + ", ".join(repr(c[:60]) for c in comps[:4])
                         + (" ..." if len(comps) > 4 else ""))
        return "\n".join(lines)

    try:
        if style.get("positional") == "probe":
            raw = _probe_reward(reward_func, lists, list(batch_items), style)
        else:
            raw = reward_func(*_reward_args(style, lists, list(prompts)),
                              **_reward_kwargs(style, list(prompts), list(batch_items)))
    except Exception as exc:
        raise ValueError(
            f"reward_func raised {type(exc).__name__}: {exc}\non these completions:\n{shown()}"
        ) from exc
    if hasattr(raw, "tolist"):
        raw = raw.tolist()
    if n == 1 and isinstance(raw, (int, float)) and not isinstance(raw, bool):
        raw = [raw]             # one joint action: a bare number is its reward, as in comlrl
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
