"""Evaluation: one sampled path per eval prompt through every turn, logged under `eval/`.

Evaluation draws from its own seeds (tagged with the env_step it runs at), never advances
env_step, and so never changes the training samples that follow it.
"""

from __future__ import annotations

from typing import Any

from comlrl.rollout import StepRecord, run_episode_batch


def run_evaluation(trainer: Any, session: Any, num_eval_samples: int | None = None) -> dict:
    """Metrics of the current policy on the first `num_eval_samples` eval rows."""
    rows = trainer.eval_rows
    if not rows:
        return {}
    args = trainer.args
    n = len(rows) if num_eval_samples is None else min(int(num_eval_samples), len(rows))
    episodes = []
    for start in range(0, n, args.eval_batch_size):
        idx = list(range(start, min(start + args.eval_batch_size, n)))
        episodes += run_episode_batch(trainer, session, 0, idx, StepRecord(), rows=rows,
                                      seed_tag=("eval", trainer.env_step), num_generations=1,
                                      evaluation=True)
    turns = args.num_turns
    rewards = [[ep.nodes[t].rewards[0] if t < len(ep.nodes) else 0.0 for t in range(turns)]
               for ep in episodes]
    metrics: dict[str, float] = {}
    # The return from turn t on, discounted as training's returns are (comlrl 1.4.3 applies
    # `discount` nowhere; README "Differences").
    for t in range(turns):
        metrics[f"eval/turn_{t + 1}/reward_mean"] = sum(r[t] for r in rewards) / len(rewards)
        metrics[f"eval/turn_{t + 1}/expected_return"] = sum(
            sum(args.discount ** i * x for i, x in enumerate(r[t:])) for r in rewards
        ) / len(rewards)
    if trainer.eval_logger is not None and trainer.eval_aggregator is not None:
        completions = trainer._eval_completions(episodes)   # per agent (or role)
        detailed = trainer.eval_logger(agent_completions_turns=completions,
                                       batch_items=[ep.row for ep in episodes],
                                       prompts=[ep.row.get("prompt", "") for ep in episodes])
        for key, value in trainer.eval_aggregator(detailed, num_turns=turns).items():
            metrics[f"eval/{key}"] = value
    return metrics
