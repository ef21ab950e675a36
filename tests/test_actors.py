"""Which parked actors a later train() may take (workers/actors.py `warm_key`): pure, no Ray."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from comlrl.config import MAGRPOConfig
from comlrl.tiny_model import build_tiny_model
from workers.actors import actor_settings, model_shape, warm_key
from workers.launch import plan_placement


def _key(args: MAGRPOConfig, folders: list[str], logs: str = "/runs/logs") -> str:
    trainer = SimpleNamespace(args=args, num_agents=2,
                              tokenizers=[SimpleNamespace(eos_token_id=2)] * 2)
    plan = plan_placement(args, 2)
    workers = 2 * args.rollout_workers_per_agent
    needs = [("rollout", plan["rollout"])] * workers + [("learner", plan["learner"])] * 2
    return warm_key(actor_settings(trainer, plan, 2, workers), needs, plan, folders, logs, None)


def test_only_the_weights_may_differ(tmp_path: Path):
    """Models that differ only in their weights (two seeds) give the same key: the weights
    are pushed. Another architecture, another setting that builds the actors, or another log
    folder gives another key, so those actors are dropped and new ones started."""
    a = build_tiny_model(tmp_path / "a", seed=0)
    b = build_tiny_model(tmp_path / "b", seed=1)
    for folder in (a, b):   # the builder's own record of its seed; sessions save without it
        (folder / "tiny_model.json").unlink()
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()
    assert model_shape(str(a)) == model_shape(str(b))
    base = _key(MAGRPOConfig(), [str(a)] * 2)
    assert _key(MAGRPOConfig(), [str(b)] * 2) == base
    # What a resume may change without touching the actors keeps the key.
    assert _key(MAGRPOConfig(num_train_epochs=9, logging_steps=3), [str(a)] * 2) == base

    config = json.loads((b / "config.json").read_text())
    config["rope_theta"] = float(config.get("rope_theta", 10000.0)) * 2
    (b / "config.json").write_text(json.dumps(config))
    assert _key(MAGRPOConfig(), [str(a), str(b)]) != base
    assert _key(MAGRPOConfig(agent_learning_rate=1e-3), [str(a)] * 2) != base
    assert _key(MAGRPOConfig(max_new_tokens=7), [str(a)] * 2) != base
    assert _key(MAGRPOConfig(rollout_workers_per_agent=2), [str(a)] * 2) != base
    assert _key(MAGRPOConfig(), [str(a)] * 2, logs="/elsewhere/logs") != base
