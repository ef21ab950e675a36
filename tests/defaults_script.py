"""Runs with every resource setting at its default, as a user on a small machine would:
3 agents, then 2 agents with 2 rollout workers each, in one process (its own local Ray).

    python tests/defaults_script.py --model M
Prints one line per run: `RUN <name> env_step=<n> cpus=<Ray's logical CPUs>`.
"""

import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
cli = parser.parse_args()

import ray  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer  # noqa: E402


def reward(*completions):
    return [-sum(len(c[j]) for c in completions) / 40.0 for j in range(len(completions[0]))]


data = Dataset.from_dict({"prompt": ["Describe a city in the clouds:", "Design a playground:"]})
for name, agents, extra in (("three-agents", 3, {}),
                            ("two-workers-per-agent", 2, {"rollout_workers_per_agent": 2})):
    trainer = MAGRPOTrainer(
        agent_model=cli.model, num_agents=agents, reward_func=reward, train_dataset=data,
        tokenizer=AutoTokenizer.from_pretrained(cli.model),
        args=MAGRPOConfig(num_turns=1, num_train_epochs=1, num_generations=2, max_new_tokens=8,
                          logging_steps=1, verbose=False, **extra))
    trainer.train()
    print(f"RUN {name} env_step={trainer.env_step} "
          f"cpus={ray.cluster_resources().get('CPU')}", flush=True)
