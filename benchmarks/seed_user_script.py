"""The seed example's training half as a user writes it, with timestamps around each phase.

bench_seed.py runs this very file twice: with this project's virtualenv and with one holding
comlrl 1.4.3. Both import `comlrl` the same way, so the only difference is the library. It
imports nothing of this repository's library (the seed example's reward is loaded from the
file examples/rewards.py, leaving `comlrl` to the virtualenv) and writes its timestamps
(time.time()) to --out.

    python seed_user_script.py --model DIR --epochs N --out times.json [--checkpoint-dir D]
                               [--resume-epochs M]
"""

import time

T_PROCESS = time.time()

import argparse
import importlib.util
import json
import os
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--epochs", type=int, required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--checkpoint-dir", default=None,
                    help="checkpoint every epoch (keeping the newest), as the seed example does")
parser.add_argument("--colocate", choices=("True", "False"), default=None,
                    help="this project only: MAGRPOConfig(colocate=...) (default: its 'auto')")
parser.add_argument("--engine-dtype", default=None,
                    help="this project only: MAGRPOConfig(engine_dtype=...) (default: 'auto')")
parser.add_argument("--resume-epochs", type=int, default=None,
                    help="the whole seed example as written: train --epochs with a checkpoint "
                         "every epoch (all kept) into --checkpoint-dir, then build a new trainer "
                         "and resume from the newest checkpoint to this many epochs, same process")
cli = parser.parse_args()
os.environ.setdefault("WANDB_MODE", "offline")

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

T_IMPORTED = time.time()

model_name = cli.model
tokenizer = AutoTokenizer.from_pretrained(model_name)
train_dataset = Dataset.from_dict({
    "prompt": [
        "Describe a city in the clouds:",
        "Invent a new holiday and explain it:",
        "Write a bedtime story for a dragon:",
        "Design a playground on Mars:",
    ]
})

# The seed example's reward, from its one copy. Loaded by file path, not by putting the
# repository on sys.path, which would make `comlrl` this repository's on both sides.
rewards_file = Path(__file__).resolve().parents[1] / "examples" / "rewards.py"
spec = importlib.util.spec_from_file_location("seed_example_rewards", rewards_file)
rewards = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rewards)
length_ratio_reward = rewards.length_ratio_reward



def build_trainer(num_train_epochs, wandb_config, agents=None):
    config = MAGRPOConfig(
        num_turns=1,
        num_train_epochs=num_train_epochs,
        num_generations=4,
        max_new_tokens=64,
        logging_steps=1,
        **({"colocate": cli.colocate == "True"} if cli.colocate else {}),
        **({"engine_dtype": cli.engine_dtype} if cli.engine_dtype else {}),
    )
    return MAGRPOTrainer(
        agents=agents or [AutoModelForCausalLM.from_pretrained(model_name) for _ in range(2)],
        tokenizer=tokenizer,
        reward_func=length_ratio_reward,
        train_dataset=train_dataset,
        args=config,
        wandb_config=wandb_config,
    )


wandb_config = {"project": "comlrl-bench", "name": "bench-seed"}
agents = [AutoModelForCausalLM.from_pretrained(model_name) for _ in range(2)]
T_MODELS = time.time()
trainer = build_trainer(cli.epochs, wandb_config, agents)
T_CONSTRUCTED = time.time()
if cli.resume_epochs:
    trainer.train(checkpoint_dir=cli.checkpoint_dir, checkpoint_interval=1)
elif cli.checkpoint_dir:
    trainer.train(checkpoint_dir=cli.checkpoint_dir, checkpoint_interval=1,
                  checkpoint_total_limit=1)
else:
    trainer.train()
T_TRAINED = time.time()
T_RESUME_BUILD = T_RESUME_START = T_RESUMED = None
if cli.resume_epochs:
    # The seed example's second half, as written.
    from comlrl.utils import read_checkpoint_metadata

    T_RESUME_BUILD = time.time()
    checkpoint = max(
        Path(cli.checkpoint_dir).glob("checkpoint-*"),
        key=lambda path: int(path.name.rsplit("-", 1)[1]),
    )
    identity = read_checkpoint_metadata(checkpoint)["wandb"]
    if identity:
        wandb_config = {**wandb_config, **identity, "resume": "allow"}
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
               "resumed": T_RESUMED,
               "model_loaded_from": model_name}, f)
