"""What one training step logs: the step's metrics from its episodes and its StepRecord.

Pure (no Ray, no W&B), so the metric names and values are unit-testable; the session sends
the result to W&B at `step=env_step` (docs/architecture.md, "env_step, checkpoints, W&B").
"""

from __future__ import annotations

from typing import Any

from comlrl.rollout import Node, StepRecord


def turn_stats(nodes: list[Node]) -> list[tuple[float, float, int]]:
    """Per turn: mean of node mean rewards, mean of node mean returns, node count."""
    per_turn: dict[int, list[tuple[float, float]]] = {}
    for node in nodes:
        per_turn.setdefault(node.turn, []).append(
            (sum(node.rewards) / len(node.rewards), sum(node.returns) / len(node.returns)))
    out = []
    for turn in range(max(per_turn) + 1 if per_turn else 0):
        vals = per_turn.get(turn, [])
        n = len(vals)
        out.append((sum(v[0] for v in vals) / max(n, 1), sum(v[1] for v in vals) / max(n, 1), n))
    return out


def step_metrics(nodes: list[Node], record: StepRecord, args: Any,
                 epoch: int) -> dict[str, float]:
    """Rewards and returns per turn of the nodes an update trained on, reference KL,
    per-agent loss / length / policy version, timings and throughput (`epoch` from 0)."""
    metrics: dict[str, float] = {}
    for turn, (reward_mean, expected_return, n) in enumerate(turn_stats(nodes)):
        if n:
            metrics[f"turn_{turn + 1}/reward_mean"] = reward_mean
            metrics[f"turn_{turn + 1}/expected_return"] = expected_return
    kls = [res["reference_kl"] for res in record.learner if "reference_kl" in res]
    for turn in sorted({t for k in kls for t in k}):
        mean = sum(k[turn] for k in kls if turn in k) / sum(1 for k in kls if turn in k)
        metrics[f"turn_{turn + 1}/reference_kl_mean"] = mean
        metrics[f"turn_{turn + 1}/reference_kl_penalty_mean"] = args.reference_kl_coef * mean
    for a, res in enumerate(record.learner):
        lengths = [len(c) for node in nodes for c in node.token_ids[a]]
        metrics[f"agent_{a}/loss"] = res["loss"]
        metrics[f"agent_{a}/completion_length"] = sum(lengths) / max(len(lengths), 1)
        metrics[f"agent_{a}/policy_version"] = record.policy_versions.get(a, 0)
    metrics["timing/generation_s"] = record.generation
    metrics["timing/learning_s"] = record.learning
    metrics["timing/weight_sync_s"] = record.weight_sync
    metrics["throughput/generation_tokens_per_s"] = record.tokens / max(record.generation, 1e-9)
    metrics["train/epoch"] = epoch + 1
    return metrics
