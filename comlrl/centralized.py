"""Centralized collaboration: one joint policy writes every role's response in one completion.

The joint text is what the policy is trained on; it is split into the roles' responses only
where the task looks at them (the reward, the evaluation logger). Pure logic over strings:
no vLLM, no Ray, no torch (tests/test_centralized.py).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from comlrl import rewards
from comlrl.inputs import build_formatters


class CentralizedReward:
    """The reward the trainer's one agent is given: per joint completion, the adapter splits it
    into `num_roles` responses and the task reward scores them as comlrl 1.4.3 scores one joint
    action of `num_roles` agents (one completion per role, prompts=[role 0's prompt],
    batch_items=[row]), once per completion.

    `adapter.build_prompt(row, role_prompts) -> str` joins the roles' prompts (each role's
    formatter applied to the row) into the policy's prompt; `adapter.parse_completion(text,
    row, num_roles) -> [str] * num_roles` splits a completion.
    """

    def __init__(self, adapter: Any, formatters: Any, reward_func: Callable, num_roles: int):
        self.adapter = adapter
        self.num_roles = num_roles
        self.role_formatters = build_formatters(formatters, num_roles)
        self.task_reward = reward_func
        self.task_style = rewards.reward_call_style(reward_func, num_roles)

    def build_prompt(self, row: dict) -> str:
        prompt = self.adapter.build_prompt(row, [f(row) for f in self.role_formatters])
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(
                f"centralized_adapter.build_prompt must return a non-empty string (got "
                f"{prompt!r} for the row {_short(row)}).")
        return prompt

    def split(self, completion: str, row: dict) -> list[str]:
        outputs = self.adapter.parse_completion(completion, row, self.num_roles)
        if isinstance(outputs, (str, bytes)):
            raise TypeError("centralized_adapter.parse_completion must return a sequence of "
                            f"{self.num_roles} strings, not one string ({outputs[:60]!r}).")
        outputs = list(outputs)
        if len(outputs) != self.num_roles:
            raise ValueError(
                f"centralized_adapter.parse_completion must return exactly {self.num_roles} "
                f"outputs (one per role); it returned {len(outputs)} for {completion[:60]!r}.")
        if not all(isinstance(o, str) for o in outputs):
            raise TypeError("centralized_adapter.parse_completion's outputs must all be "
                            f"strings (got {[type(o).__name__ for o in outputs]}).")
        return outputs

    def __call__(self, completions: Sequence[str], *, prompts: Sequence[str] | None = None,
                 batch_items: Sequence[dict] | None = None) -> list[float]:
        if not batch_items or len(batch_items) not in (1, len(completions)):
            raise ValueError("centralized rewards need batch_items, one row per completion.")
        scores = []
        for i, completion in enumerate(completions):
            row = batch_items[0] if len(batch_items) == 1 else batch_items[i]
            roles = [[output] for output in self.split(completion, row)]
            scores += rewards.call_reward(self.task_reward, roles,
                                          prompts=[self.role_formatters[0](row)],
                                          batch_items=[row], style=self.task_style)
        return scores

    def split_eval(self, completions: list, rows: Sequence[dict]) -> list:
        """The evaluation logger's `agent_completions_turns` per role: `completions` holds the
        one agent's [per row [per turn text]]; each text is split as the reward splits it."""
        (joint,) = completions
        per_role: list = [[] for _ in range(self.num_roles)]
        for turns, row in zip(joint, rows):
            split_turns = [self.split(text, row) for text in turns]
            for r in range(self.num_roles):
                per_role[r].append([roles[r] for roles in split_turns])
        return per_role


def _short(row: dict) -> str:
    text = repr(row)
    return text if len(text) <= 80 else text[:77] + "..."
