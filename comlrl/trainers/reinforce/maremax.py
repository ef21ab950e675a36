"""comlrl's MAReMax (`comlrl.trainers.reinforce.maremax`, its module path): MAGRPO whose
advantage subtracts the best return of the group: A = R - max(R)."""

from __future__ import annotations

from dataclasses import dataclass

from comlrl.config import MAGRPOConfig
from comlrl.trainers.reinforce.magrpo import MAGRPOTrainer


@dataclass
class MAReMaxConfig(MAGRPOConfig):
    """MAGRPOConfig with MAReMax's advantage (`advantage_mode="max"`)."""

    advantage_mode: str = "max"
    """MAReMax's baseline; any of MAGRPO's modes may still be set."""


class MAReMaxTrainer(MAGRPOTrainer):
    default_config_cls = MAReMaxConfig
    algorithm_name = "MAReMax"
