"""RewardProcessors: ready-made `reward_processor` callables (comlrl 1.4.3's API).

A reward processor maps one raw reward (a float) to the reward used for training; pass it as
`MAGRPOTrainer(reward_processor=...)`. The trainer applies it to every reward its reward
function returns, before checking that the result is finite.
"""

from __future__ import annotations

from typing import Callable


class RewardProcessors:
    """Factories of reward processors, used as static methods: `RewardProcessors.scale(2.0)`."""

    @staticmethod
    def scale(factor=1.0) -> Callable:
        """A processor that multiplies each reward by `factor` (1.0: unchanged)."""

        def scaled(reward):
            return reward * factor

        return scaled

    @staticmethod
    def shift(value=0.0) -> Callable:
        """A processor that adds `value` to each reward (0.0: unchanged)."""

        def shifted(reward):
            return reward + value

        return shifted
