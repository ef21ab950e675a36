"""The seed example's trainer, run as its own process by the resume tests.

    python tests/seed_script.py --model M --checkpoint-dir D --epochs N [--resume PATH|latest]
"""

import argparse
import os
import sys
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--checkpoint-dir", required=True)
parser.add_argument("--epochs", type=int, required=True)
parser.add_argument("--resume", default=None)
parser.add_argument("--name", default="seed")
parser.add_argument("--pause-before-publish", type=float, default=0.0,
                    help="seconds the checkpointer holds each staged checkpoint before "
                         "publishing it (tests kill the run meanwhile)")
parser.add_argument("--again", default=None, metavar="CHECKPOINT_DIR",
                    help="then train a second, fresh trainer of the same settings into this "
                         "folder, in this same process")
parser.add_argument("--override", action="append", default=[],
                    help="MAGRPOConfig field=value (python literal)")
cli = parser.parse_args()

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from comlrl.utils import read_checkpoint_metadata

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: examples.*
from examples.rewards import length_ratio_reward  # noqa: E402

PROMPTS = ["Describe a city in the clouds:", "Invent a new holiday and explain it:",
           "Write a bedtime story for a dragon:", "Design a playground on Mars:"]


settings = dict(num_turns=1, num_train_epochs=cli.epochs, num_generations=4, max_new_tokens=64,
                logging_steps=1)
for item in cli.override:
    key, value = item.split("=", 1)
    settings[key] = eval(value)
wandb_config = {"project": "comlrl-tests", "name": cli.name}
resume = cli.resume
if resume == "latest":
    from comlrl.checkpoint import list_checkpoints

    resume = str(list_checkpoints(cli.checkpoint_dir)[-1])
if resume:
    wandb_config = {**wandb_config, **read_checkpoint_metadata(resume)["wandb"],
                    "resume": "allow"}


def build(wandb_config):
    return MAGRPOTrainer(
        agents=[AutoModelForCausalLM.from_pretrained(cli.model) for _ in range(2)],
        tokenizer=AutoTokenizer.from_pretrained(cli.model), reward_func=length_ratio_reward,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), args=MAGRPOConfig(**settings),
        wandb_config=wandb_config)


trainer = build(wandb_config)
if cli.pause_before_publish:
    import time

    pause = cli.pause_before_publish
    trainer._checkpoint_before_publish = lambda staging: time.sleep(pause)
trainer.train(checkpoint_dir=cli.checkpoint_dir, checkpoint_interval=1,
              resume_from_checkpoint=resume)
if cli.again:
    trainer = build({"project": "comlrl-tests", "name": f"{cli.name}-again"})
    trainer.train(checkpoint_dir=cli.again, checkpoint_interval=1)
print(f"DONE env_step={trainer.env_step} pid={os.getpid()}")
