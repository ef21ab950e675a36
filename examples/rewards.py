"""Reward functions that YAML configs name as `examples.rewards:<function>`.

A reward function gets one list of completions per agent (positionally) and returns one float
per joint action, as in comlrl. `workers.cli` imports this module by name from the working dir.

`length_ratio_reward` is the seed example's reward and this is its one copy: the demo, the
tests and the benchmarks import it from here.
"""

import math


def length_ratio_reward(completions1, completions2):
    """The seed example's reward: 1.0 when the second agent's answer is 2-3x as long as the
    first's, decaying as exp(-distance) from that range."""
    rewards = []
    for first, second in zip(completions1, completions2):
        ratio = len(second) / max(len(first), 1)
        distance = 0.0 if 2 <= ratio <= 3 else min(abs(ratio - 2), abs(ratio - 3))
        rewards.append(math.exp(-distance))
    return rewards
