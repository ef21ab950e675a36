"""Utilities users import from comlrl."""

from comlrl.checkpoint import read_checkpoint_metadata
from comlrl.tiny_model import build_tiny_model
from comlrl.utils.reward_processor import RewardProcessors

__all__ = ["read_checkpoint_metadata", "build_tiny_model", "RewardProcessors"]
