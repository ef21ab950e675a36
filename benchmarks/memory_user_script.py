"""The whole seed example as a user writes it (seed_user_script.py's --resume-epochs flow), with
its phases written down for bench_memory.py.

2 agents, the 4 seed prompts, K=4, 64 new tokens, one turn, the length-ratio reward, W&B
offline: train --epochs with a checkpoint every epoch into --checkpoint-dir, then a new trainer
resumes from the newest checkpoint to --resume-epochs, in this same process. bench_memory.py
runs this file with either virtualenv; like seed_user_script.py it imports nothing of this
repository's library itself (the reward is loaded from examples/rewards.py by path).

Each phase appends "<time.time()> <phase> start" and "... end" lines to --phase-log. The
script's own phases, on both sides: "load models" (the first trainer's agents), "construct"
(each MAGRPOTrainer(...)), "train" (the first train()) and "resume" (the second trainer's
construction and train()). Where `workers.driver.session` imports (this project), its Session's
methods are wrapped too: _start -> "start", generate -> "generation", update_and_push ->
"update" (with the push to colocated engines), push_weights -> "push", save_checkpoint and
wait_checkpoint -> "checkpoint", pull_weights -> "pull back". comlrl 1.4.3 has no such class.

    python memory_user_script.py --model DIR --phase-log FILE --out times.json
                                 --checkpoint-dir D [--epochs 2] [--resume-epochs 4]
                                 [--setting gradient_checkpointing=True ...]
                                 [--lora r=16 --lora "target_modules='all-linear'" ...]
"""

import time

T_PROCESS = time.time()

import argparse
import ast
import contextlib
import functools
import importlib.util
import json
import os
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--phase-log", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--checkpoint-dir", required=True)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--resume-epochs", type=int, default=4)
parser.add_argument("--setting", action="append", default=[], metavar="FIELD=VALUE",
                    help="a further MAGRPOConfig field (a Python literal), both trainers")
parser.add_argument("--agents", type=int, default=2, choices=(1, 2, 3, 4),
                    help="agents (the seed example has 2; others score the first and last)")
parser.add_argument("--lora", action="append", default=[], metavar="FIELD=VALUE",
                    help="LoRA agents: peft.LoraConfig fields (Python literals), both trainers")
cli = parser.parse_args()
os.environ.setdefault("WANDB_MODE", "offline")

_log = open(cli.phase_log, "a", buffering=1)


def mark(phase: str, edge: str) -> None:
    _log.write(f"{time.time():.3f} {phase} {edge}\n")


@contextlib.contextmanager
def phase(name: str):
    mark(name, "start")
    try:
        yield
    finally:
        mark(name, "end")


def traced(name: str, method):
    """`method`, unchanged in what it takes and returns, inside phase `name`."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with phase(name):
            return method(*args, **kwargs)
    return wrapper


from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

SESSION_PHASES = {"_start": "start", "generate": "generation", "update_and_push": "update",
                  "push_weights": "push", "save_checkpoint": "checkpoint",
                  "wait_checkpoint": "checkpoint", "pull_weights": "pull back"}
try:
    from workers.driver.session import Session
except Exception as exc:  # noqa: BLE001 - comlrl 1.4.3 (ImportError): its internals differ
    print(f"memory_user_script: not tracing workers.driver.session ({type(exc).__name__})", flush=True)
    Session = None
traced_methods = []
if Session is not None:
    for method_name, phase_name in SESSION_PHASES.items():
        method = getattr(Session, method_name, None)
        if callable(method):
            setattr(Session, method_name, traced(phase_name, method))
            traced_methods.append(method_name)

T_IMPORTED = time.time()

model_name = cli.model
SETTINGS = {k: ast.literal_eval(v) for k, v in (item.split("=", 1) for item in cli.setting)}
LORA = {k: ast.literal_eval(v) for k, v in (item.split("=", 1) for item in cli.lora)}
if LORA:
    from peft import LoraConfig
tokenizer = AutoTokenizer.from_pretrained(model_name)
train_dataset = Dataset.from_dict({
    "prompt": [
        "Describe a city in the clouds:",
        "Invent a new holiday and explain it:",
        "Write a bedtime story for a dragon:",
        "Design a playground on Mars:",
    ]
})

rewards_file = Path(__file__).resolve().parents[1] / "examples" / "rewards.py"
spec = importlib.util.spec_from_file_location("seed_example_rewards", rewards_file)
rewards = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rewards)
length_ratio_reward = rewards.length_ratio_reward


def one_agent(completions1):
    return length_ratio_reward(completions1, completions1)


def three_agents(completions1, completions2, completions3):
    return length_ratio_reward(completions1, completions3)


def four_agents(completions1, completions2, completions3, completions4):
    return length_ratio_reward(completions1, completions4)


REWARD = {1: one_agent, 2: length_ratio_reward, 3: three_agents, 4: four_agents}[cli.agents]


def build_trainer(num_train_epochs, wandb_config, agents=None):
    config = MAGRPOConfig(
        num_turns=1,
        num_train_epochs=num_train_epochs,
        num_generations=4,
        max_new_tokens=64,
        logging_steps=1,
        **SETTINGS,
    )
    return MAGRPOTrainer(
        agents=agents or [AutoModelForCausalLM.from_pretrained(model_name) for _ in range(cli.agents)],
        tokenizer=tokenizer,
        reward_func=REWARD,
        train_dataset=train_dataset,
        args=config,
        wandb_config=wandb_config,
        **({"peft_config": LoraConfig(**LORA)} if LORA else {}),
    )


wandb_config = {"project": "comlrl-bench", "name": "bench-memory"}
with phase("load models"):
    agents = [AutoModelForCausalLM.from_pretrained(model_name) for _ in range(cli.agents)]
T_MODELS = time.time()
with phase("construct"):
    trainer = build_trainer(cli.epochs, wandb_config, agents)
T_CONSTRUCTED = time.time()
with phase("train"):
    trainer.train(checkpoint_dir=cli.checkpoint_dir, checkpoint_interval=1)
T_TRAINED = time.time()

# The seed example's second half, as written: a new trainer resumes from the newest checkpoint.
from comlrl.utils import read_checkpoint_metadata

with phase("resume"):
    checkpoint = max(
        Path(cli.checkpoint_dir).glob("checkpoint-*"),
        key=lambda path: int(path.name.rsplit("-", 1)[1]),
    )
    identity = read_checkpoint_metadata(checkpoint)["wandb"]
    if identity:
        wandb_config = {**wandb_config, **identity, "resume": "allow"}
    T_RESUME_BUILD = time.time()
    with phase("construct"):
        trainer = build_trainer(cli.resume_epochs, wandb_config)
    T_RESUME_START = time.time()
    trainer.train(
        resume_from_checkpoint=str(checkpoint),
        checkpoint_dir=cli.checkpoint_dir,
        checkpoint_interval=1,
    )
    T_RESUMED = time.time()
try:  # comlrl 1.4.3 leaves its W&B run open after train(); close it like a script's end does
    import wandb

    if wandb.run is not None:
        wandb.finish()
except ImportError:
    pass
T_FINISHED = time.time()

with open(cli.out, "w") as f:
    json.dump({"process_start": T_PROCESS, "imported": T_IMPORTED, "models_loaded": T_MODELS,
               "constructed": T_CONSTRUCTED, "trained": T_TRAINED, "finished": T_FINISHED,
               "resume_build": T_RESUME_BUILD, "resume_start": T_RESUME_START,
               "resumed": T_RESUMED, "traced_methods": traced_methods,
               "epochs": [cli.epochs, cli.resume_epochs]}, f)
