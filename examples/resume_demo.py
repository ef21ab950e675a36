"""The user's example "Resume training" (shared/seed-example.md), as written.

One change only, as the example allows: `model_name` comes from `--model` or COMLRL_MODEL and
defaults to a tiny random-weight Qwen2-style model built on the spot (no hub is reachable).
W&B runs offline unless WANDB_MODE says otherwise. The reward is the example's, imported from
examples/rewards.py (its one copy in this repository). After training, the run's curve is read
back from its W&B files and drawn into <output folder>/training-curve.png (needs matplotlib).

    python examples/resume_demo.py [--model PATH] [--output-dir DIR] [--first-half-only]
"""

import argparse
import os
import sys
from pathlib import Path

# This file runs as a script; the repository root makes `examples.*` importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
from workers.console import full_output

if not full_output():
    # The console shows the run's header, progress and summary; full output (COMLRL_VERBOSE=1)
    # shows the model-loading bars too.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


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

from examples.rewards import length_ratio_reward


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

# ---------------------------------------------------------------- the training curve, as a PNG

wandb_dir = Path(os.environ["WANDB_DIR"])


def draw_training_curve():
    """Reward against env_step, read back from the run's W&B files: the first half and the
    resumed half in two colours, the resume point marked."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print('training curve: not drawn, matplotlib is missing; install it with '
              '`.venv/bin/pip install -e ".[plot]"` (deploy/setup.sh does)')
        return
    from examples.training_curve import REWARD_KEY, plot_training_curve, wandb_history

    newest = list_checkpoints(checkpoint_dir)[-1]
    run_id = (read_checkpoint_metadata(newest)["wandb"] or {}).get("id")
    records = wandb_history(wandb_dir, run_id) if run_id else []
    if not any(REWARD_KEY in r for r in records):
        print(f"training curve: not drawn, no {REWARD_KEY} in the W&B files under {wandb_dir}")
        return
    resume_step = resume_label = None
    if not cli.first_half_only:
        resume_step = read_checkpoint_metadata(checkpoint)["env_step"]
        resume_label = f"resumed from {checkpoint.name} (env_step {resume_step})"
    png = plot_training_curve(records, out / "training-curve.png", resume_step=resume_step,
                              resume_label=resume_label,
                              title="resume-demo: reward during training")
    print(f"training curve: {png}")


draw_training_curve()
