"""comlrl's CentralizedMAGRPO: one joint policy answers for every role in one completion.

It is MAGRPO with one agent: the prompt joins the roles' prompts (`centralized_adapter`), the
reward splits each completion into the roles' responses before the task reward sees them
(`comlrl.centralized.CentralizedReward`), and the update trains on the joint text. So it runs on
the same engines, learners, checkpoints and resume as MAGRPO.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from comlrl.centralized import CentralizedReward
from comlrl.config import MAGRPOConfig
from comlrl.trainers.reinforce.magrpo import MAGRPOTrainer


@dataclass
class CentralizedMAGRPOConfig(MAGRPOConfig):
    """MAGRPOConfig for one joint policy; `num_agents` counts the roles it answers for."""

    num_turns: int = 1
    """Turns per episode; comlrl 1.4.3's centralized trainer supports only 1."""
    collaboration_mode: str = "centralized"
    """comlrl's marker of this configuration; anything but "centralized" is refused."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.collaboration_mode != "centralized":
            raise ValueError("CentralizedMAGRPOConfig requires centralized collaboration.")
        if self.num_turns != 1:
            raise ValueError("Centralized MAGRPO currently supports num_turns=1 only.")


class CentralizedMAGRPOTrainer(MAGRPOTrainer):
    """Train one joint policy; its completions are split into role responses for the reward
    and the evaluation logger (comlrl 1.4.3's call form, keyword arguments only):

        CentralizedMAGRPOTrainer(centralized_adapter=adapter, num_agents=2,
                                 agent_model="path", reward_func=reward, args=config)

    `num_agents` is the number of roles and must equal `args.num_agents`; `reward_func` takes
    one list per role, as MAGRPO's takes one per agent; `formatters` are the roles'.
    """

    default_config_cls = CentralizedMAGRPOConfig

    def __init__(self, *, centralized_adapter: Any, num_agents: int = 2, agents: Any = None,
                 tokenizer: Any = None, reward_func: Any = None, formatters: Any = None,
                 args: MAGRPOConfig | None = None, **kwargs: Any):
        # comlrl 1.4.3's checks, in its order and words.
        config = args if args is not None else self.default_config_cls()
        if getattr(config, "collaboration_mode", None) != "centralized":
            raise ValueError("CentralizedMAGRPOTrainer requires centralized configuration.")
        if config.num_turns != 1:
            raise ValueError("Centralized MAGRPO currently supports num_turns=1 only.")
        if num_agents != config.num_agents:
            raise ValueError("num_agents must match args.num_agents (the role count).")
        if agents is not None and len(agents) != 1:
            raise ValueError("Centralized collaboration requires exactly one actor model.")
        if isinstance(tokenizer, (list, tuple)) and len(tokenizer) != 1:
            raise ValueError("Centralized collaboration requires one actor tokenizer.")
        if not callable(reward_func):
            raise ValueError("reward_func must be callable.")
        for name in ("build_prompt", "parse_completion"):
            if not callable(getattr(centralized_adapter, name, None)):
                raise TypeError(f"centralized_adapter.{name} must be callable.")
        self.centralized_collaboration = CentralizedReward(
            centralized_adapter, formatters, reward_func, num_agents)
        super().__init__(agents=agents, tokenizer=tokenizer, num_agents=1, args=config,
                         reward_func=self.centralized_collaboration,
                         formatters=self.centralized_collaboration.build_prompt, **kwargs)
        # The base counts the one model in args.num_agents; comlrl keeps the role count there.
        self.args.num_agents = num_agents

    def _eval_completions(self, episodes: list) -> list:
        joint = super()._eval_completions(episodes)
        return self.centralized_collaboration.split_eval(joint, [ep.row for ep in episodes])

    def _user_callables(self) -> dict:
        """MAGRPO's, with the user's own callables in place of the wrapper around them: the
        task reward, the roles' formatters, and the adapter (its class source and state)."""
        collab = self.centralized_collaboration
        return {**super()._user_callables(), "reward_func": collab.task_reward,
                "formatters": [getattr(f, "user", None) for f in collab.role_formatters],
                "centralized_adapter": collab.adapter}
