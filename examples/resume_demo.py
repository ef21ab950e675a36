"""The user's example "Resume training" (shared/seed-example.md), as written.

One change only, as the example allows: `model_name` comes from `--model` or COMLRL_MODEL and
defaults to a tiny random-weight Qwen2-style model built on the spot (no hub is reachable).
W&B runs offline unless WANDB_MODE says otherwise.

    python examples/resume_demo.py [--model PATH] [--output-dir DIR] [--first-half-only]
"""

import argparse
import math
import os
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default=os.environ.get("COMLRL_MODEL"),
                    help="model folder or hub name (default: a tiny model built locally)")
parser.add_argument("--output-dir", default=os.environ.get("COMLRL_OUTPUT"),
                    help="where checkpoints, the tiny model and W&B files go (default: "
                         "runs/resume-demo, or runs/resume-demo-N when that holds a run)")
parser.add_argument("--first-half-only", action="store_true",
                    help="stop after the first two epochs")
cli = parser.parse_args()

# A second run of the README's command starts a new run in a new folder: the example's first
# half refuses a checkpoint_dir that already holds another run's checkpoints (the trainer's
# own test, list_checkpoints, decides here too).
from comlrl.checkpoint import list_checkpoints


def holds_a_run(folder):
    return bool(list_checkpoints(folder / "checkpoints" / "resume-demo"))


if cli.output_dir is None:
    out, n = Path("runs/resume-demo"), 1
    while holds_a_run(out):
        n += 1
        out = Path(f"runs/resume-demo-{n}")
else:
    out = Path(cli.output_dir)
    if holds_a_run(out):
        parser.error(f"--output-dir {out} already holds a run's checkpoints; pass a new folder "
                     f"or remove {out / 'checkpoints'}")
out = out.resolve()
print(f"output folder: {out}")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_DIR", str(out))
(out).mkdir(parents=True, exist_ok=True)
if cli.model is None:
    from comlrl.tiny_model import build_tiny_model

    cli.model = str(build_tiny_model(out / "tiny-model", seed=0))
    print(f"built a tiny random-weight model at {cli.model}")

# ---------------------------------------------------------------- the example, as written

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from comlrl.utils import read_checkpoint_metadata

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


def length_ratio_reward(completions1, completions2):
    rewards = []
    for first, second in zip(completions1, completions2):
        ratio = len(second) / max(len(first), 1)
        distance = 0.0 if 2 <= ratio <= 3 else min(abs(ratio - 2), abs(ratio - 3))
        rewards.append(math.exp(-distance))
    return rewards


def build_trainer(num_train_epochs, wandb_config):
    config = MAGRPOConfig(
        num_turns=1,
        num_train_epochs=num_train_epochs,
        num_generations=4,
        max_new_tokens=64,
        logging_steps=1,
    )
    return MAGRPOTrainer(
        agents=[AutoModelForCausalLM.from_pretrained(model_name) for _ in range(2)],
        tokenizer=tokenizer,
        reward_func=length_ratio_reward,
        train_dataset=train_dataset,
        args=config,
        wandb_config=wandb_config,
    )


wandb_config = {"project": "comlrl-examples", "name": "resume-demo"}
checkpoint_dir = str(out / "checkpoints" / "resume-demo")

trainer = build_trainer(num_train_epochs=2, wandb_config=wandb_config)
trainer.train(checkpoint_dir=checkpoint_dir, checkpoint_interval=1)
print("checkpoints:", sorted(p.name for p in Path(checkpoint_dir).glob("checkpoint-*")))

if not cli.first_half_only:
    checkpoint = max(
        Path(checkpoint_dir).glob("checkpoint-*"),
        key=lambda path: int(path.name.rsplit("-", 1)[1]),
    )
    identity = read_checkpoint_metadata(checkpoint)["wandb"]
    if identity:
        wandb_config = {**wandb_config, **identity, "resume": "allow"}

    trainer = build_trainer(num_train_epochs=4, wandb_config=wandb_config)
    trainer.train(
        resume_from_checkpoint=str(checkpoint),
        checkpoint_dir=checkpoint_dir,
        checkpoint_interval=1,
    )
    print("checkpoints:", sorted(p.name for p in Path(checkpoint_dir).glob("checkpoint-*")))
print(f"W&B files: {sorted(str(p) for p in (out / 'wandb').glob('offline-run-*'))}")
