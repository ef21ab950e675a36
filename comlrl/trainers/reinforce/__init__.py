"""MAGRPO and its siblings (comlrl names): each sibling fixes the advantage baseline; the
centralized trainer trains one joint policy for every role."""

from comlrl.config import MAGRPOConfig
from comlrl.trainers.reinforce.centralized_magrpo import (
    CentralizedMAGRPOConfig, CentralizedMAGRPOTrainer,
)
from comlrl.trainers.reinforce.magrpo import MAGRPOTrainer
from comlrl.trainers.reinforce.mareinforce import MAREINFORCEConfig, MAREINFORCETrainer
from comlrl.trainers.reinforce.maremax import MAReMaxConfig, MAReMaxTrainer
from comlrl.trainers.reinforce.marloo import MARLOOConfig, MARLOOTrainer

__all__ = ["CentralizedMAGRPOConfig", "CentralizedMAGRPOTrainer", "MAGRPOConfig",
           "MAGRPOTrainer", "MAREINFORCEConfig", "MAREINFORCETrainer", "MARLOOConfig",
           "MARLOOTrainer", "MAReMaxConfig", "MAReMaxTrainer"]
