"""comlrl's MAREINFORCE (`comlrl.trainers.reinforce.mareinforce`, its module path): MAGRPO whose
advantage is the raw return (REINFORCE without a baseline)."""

from __future__ import annotations

from dataclasses import dataclass

from comlrl.config import MAGRPOConfig
from comlrl.trainers.reinforce.magrpo import MAGRPOTrainer


@dataclass
class MAREINFORCEConfig(MAGRPOConfig):
    """MAGRPOConfig with MAREINFORCE's advantage (`advantage_mode="raw"`)."""

    advantage_mode: str = "raw"
    """MAREINFORCE's baseline; any of MAGRPO's modes may still be set."""


class MAREINFORCETrainer(MAGRPOTrainer):
    default_config_cls = MAREINFORCEConfig
    algorithm_name = "MAREINFORCE"
