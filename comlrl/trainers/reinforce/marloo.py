"""comlrl's MARLOO (`comlrl.trainers.reinforce.marloo`, its module path): MAGRPO whose
advantage subtracts the leave-one-out mean of the group's other returns."""

from __future__ import annotations

from dataclasses import dataclass

from comlrl.config import MAGRPOConfig
from comlrl.trainers.reinforce.magrpo import MAGRPOTrainer


@dataclass
class MARLOOConfig(MAGRPOConfig):
    """MAGRPOConfig with MARLOO's advantage (`advantage_mode="rloo"`)."""

    advantage_mode: str = "rloo"
    """MARLOO's baseline; any of MAGRPO's modes may still be set."""


class MARLOOTrainer(MAGRPOTrainer):
    default_config_cls = MARLOOConfig
    algorithm_name = "MARLOO"
