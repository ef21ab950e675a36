"""comlrl-split: MAGRPO multi-agent LLM training with vLLM rollout workers on Ray.

The public API matches the `comlrl` library: `comlrl.trainers.reinforce.MAGRPOConfig`,
`MAGRPOTrainer`, `comlrl.utils.read_checkpoint_metadata`. Heavy imports (torch, vLLM, Ray,
W&B) happen only when training starts.
"""

__version__ = "0.1.0"
