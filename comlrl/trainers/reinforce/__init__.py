"""MAGRPO and its siblings (comlrl names): each sibling fixes the advantage baseline."""

from comlrl.config import MAGRPOConfig
from comlrl.trainers.reinforce.magrpo import MAGRPOTrainer
from comlrl.trainers.reinforce.siblings import (
    MAREINFORCEConfig, MAREINFORCETrainer, MAReMaxConfig, MAReMaxTrainer, MARLOOConfig,
    MARLOOTrainer,
)

__all__ = ["MAGRPOConfig", "MAGRPOTrainer", "MAREINFORCEConfig", "MAREINFORCETrainer",
           "MARLOOConfig", "MARLOOTrainer", "MAReMaxConfig", "MAReMaxTrainer"]
