"""comlrl's sibling trainers: MAGRPO with a fixed advantage baseline (and their own name)."""

from __future__ import annotations

from dataclasses import dataclass

from comlrl.config import MAGRPOConfig
from comlrl.trainers.reinforce.magrpo import MAGRPOTrainer


@dataclass
class MAREINFORCEConfig(MAGRPOConfig):
    """MAGRPOConfig whose advantage is the raw return (REINFORCE without a baseline)."""

    advantage_mode: str = "raw"


@dataclass
class MARLOOConfig(MAGRPOConfig):
    """MAGRPOConfig whose baseline is the leave-one-out mean of the other generations."""

    advantage_mode: str = "rloo"


@dataclass
class MAReMaxConfig(MAGRPOConfig):
    """MAGRPOConfig whose baseline is the best return of the group: A = R - max(R)."""

    advantage_mode: str = "max"


class MAREINFORCETrainer(MAGRPOTrainer):
    default_config_cls = MAREINFORCEConfig
    algorithm_name = "MAREINFORCE"


class MARLOOTrainer(MAGRPOTrainer):
    default_config_cls = MARLOOConfig
    algorithm_name = "MARLOO"


class MAReMaxTrainer(MAGRPOTrainer):
    default_config_cls = MAReMaxConfig
    algorithm_name = "MAReMax"
