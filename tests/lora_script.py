"""The seed example with LoRA agents (`peft_config`), run as its own process by tests/test_lora.py.

    python tests/lora_script.py --model M --checkpoint-dir D --epochs N [--agents 3]
        [--resume PATH] [--lora FIELD=VALUE ...] [--save-model DIR]
"""

import argparse
import math
import os

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--checkpoint-dir", required=True)
parser.add_argument("--epochs", type=int, required=True)
parser.add_argument("--agents", type=int, default=3)
parser.add_argument("--resume", default=None)
parser.add_argument("--lora", action="append", default=[],
                    help="LoraConfig field=value (python literal) over the defaults here")
parser.add_argument("--save-model", default=None, help="then trainer.save_model(DIR)")
cli = parser.parse_args()

from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from comlrl.utils import read_checkpoint_metadata

PROMPTS = ["Describe a city in the clouds:", "Invent a new holiday and explain it:",
           "Write a bedtime story for a dragon:", "Design a playground on Mars:"]


def growing_lengths(*completions):
    """Each agent's response about twice as long as the one before it (the seed example's
    task, for any number of agents)."""
    rewards = []
    for joint in zip(*completions):
        score = 0.0
        for first, second in zip(joint, joint[1:]):
            ratio = len(second) / max(len(first), 1)
            score += math.exp(-abs(ratio - 2))
        rewards.append(score / max(len(joint) - 1, 1))
    return rewards


lora = dict(r=8, lora_alpha=16, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"])
for item in cli.lora:
    key, value = item.split("=", 1)
    lora[key] = eval(value)
wandb_config = {"project": "comlrl-tests", "name": "lora"}
if cli.resume:
    wandb_config = {**wandb_config, **read_checkpoint_metadata(cli.resume)["wandb"],
                    "resume": "allow"}
trainer = MAGRPOTrainer(
    agents=[AutoModelForCausalLM.from_pretrained(cli.model) for _ in range(cli.agents)],
    tokenizer=AutoTokenizer.from_pretrained(cli.model), reward_func=growing_lengths,
    train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
    args=MAGRPOConfig(num_turns=1, num_train_epochs=cli.epochs, num_generations=4,
                      max_new_tokens=64, logging_steps=1),
    wandb_config=wandb_config, peft_config=LoraConfig(**lora))
trainer.train(checkpoint_dir=cli.checkpoint_dir, checkpoint_interval=1,
              resume_from_checkpoint=cli.resume)
if cli.save_model:
    trainer.save_model(cli.save_model)
    trainer.save_model(cli.save_model + "-merged", merge=True)
print(f"DONE env_step={trainer.env_step} pid={os.getpid()}")
