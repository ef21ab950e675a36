"""Two Ray nodes on one machine (ray.cluster_utils.Cluster): rollout workers pinned to the
worker node through `rollout_resources`, learners to the head through `learner_resources`.

    python tests/two_node_script.py --model M --out result.json

Runs as its own process because it needs its own Ray (the test session already has one).
Writes the node id of every actor, seen from inside the actors during training.
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: examples.*
from examples.local_env import LOCAL_ENV  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--out", required=True)
cli = parser.parse_args()

for key, value in LOCAL_ENV.items():
    os.environ.setdefault(key, value)

import ray
from datasets import Dataset
from ray.cluster_utils import Cluster
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

cluster = Cluster(initialize_head=True, head_node_args=dict(
    num_cpus=1, resources={"learner_node": 2}, include_dashboard=False,
    object_store_memory=256 * 1024 * 1024))
worker_node = cluster.add_node(num_cpus=1, resources={"rollout_node": 4},
                               object_store_memory=256 * 1024 * 1024)
ray.init(address=cluster.address, log_to_driver=False)
seen: dict = {}
trainer = None


def reward(completions1, completions2):
    if not seen:  # first call: the actors are up; ask each where it runs
        s = trainer._session
        seen["workers"] = [ray.get(w.node_info.remote())["node_id"]
                           for ws in s.workers for w in ws]
        seen["learners"] = [ray.get(l.node_info.remote())["node_id"] for l in s.learners]
        s.sleep_engines()  # as before an update; the weight push wakes them again
    return [-(len(a) + len(b)) / 40.0 for a, b in zip(completions1, completions2)]


try:
    trainer = MAGRPOTrainer(
        agents=[AutoModelForCausalLM.from_pretrained(cli.model) for _ in range(2)],
        tokenizer=AutoTokenizer.from_pretrained(cli.model), reward_func=reward,
        train_dataset=Dataset.from_dict({"prompt": ["Describe a city in the clouds:",
                                                    "Design a playground on Mars:"]}),
        args=MAGRPOConfig(num_turns=1, num_train_epochs=1, num_generations=2,
                          max_new_tokens=8, logging_steps=1, rollout_num_cpus=0.25,
                          learner_num_cpus=0.25, rollout_resources={"rollout_node": 1},
                          learner_resources={"learner_node": 1}, rollout_engine="hf",
                          enable_sleep_mode=True,  # exercises the sleep/wake calls (no-ops here)
                          verbose=False),
        wandb_config=None)
    trainer.train()
    seen["head"] = cluster.head_node.node_id
    seen["worker_node"] = worker_node.node_id
    seen["env_step"] = trainer.env_step
    with open(cli.out, "w") as f:
        json.dump(seen, f)
finally:
    ray.shutdown()
    cluster.shutdown()
