"""comlrl 1.4.3 parity of the trainer: construction, `train()`'s arguments, W&B on resume and
after training, and default resources on a small machine (issue 10, points 3-6 and 9).

Each docstring says what comlrl 1.4.3 gave for the same call, run in its own virtualenv
(benchmarks/.venv-comlrl, built by benchmarks/bench_seed.py).
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, wandb_history


def reward(completions1, completions2):
    return [-(len(a) + len(b)) / 40.0 for a, b in zip(completions1, completions2)]


PROMPTS = ["Describe a city in the clouds:", "Design a playground on Mars:"]


def _data():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": PROMPTS})


def _config(**kw):
    from comlrl.trainers.reinforce import MAGRPOConfig

    settings = dict(num_turns=1, num_train_epochs=1, num_generations=2, max_new_tokens=8,
                    logging_steps=1, verbose=False)
    settings.update(kw)
    return MAGRPOConfig(**settings)


# ------------------------------------------------------------------ point 3: agents as names


def test_agents_given_as_model_names_load_models_and_tokenizers(tiny_model):
    """comlrl 1.4.3: `MAGRPOTrainer(agents=[path, path], reward_func=..., args=...)` without a
    tokenizer loads each model and its tokenizer from the name, and `trainer.model_name` is
    the name. (Here the models load at first use, so construction stays light.)"""
    from comlrl.trainers.reinforce import MAGRPOTrainer

    trainer = MAGRPOTrainer(agents=[tiny_model, tiny_model], reward_func=reward,
                            train_dataset=_data(), args=_config())
    assert trainer.num_agents == 2 and trainer.model_name == tiny_model
    assert [t.eos_token for t in trainer.tokenizers] == ["<|endoftext|>"] * 2
    models = trainer._initial_models()
    assert len(models) == 2 and models[0] is not models[1]
    assert models[0].config.vocab_size == trainer.tokenizers[0].vocab_size


def test_agent_model_with_a_different_agents_list_is_refused(tiny_model, tmp_path):
    """comlrl 1.4.3 raises ValueError "agent_model and agents conflict: A != [B, B]." when
    the names differ, and "agents length (1) must match num_agents (2)." for a short list.
    The same names are accepted."""
    from comlrl.trainers.reinforce import MAGRPOTrainer

    other = str(tmp_path / "other")
    with pytest.raises(ValueError, match="agent_model and agents conflict"):
        MAGRPOTrainer(agent_model=tiny_model, agents=[other, other], reward_func=reward,
                      train_dataset=_data(), args=_config())
    with pytest.raises(ValueError, match=r"agents length \(1\) must match num_agents \(2\)"):
        MAGRPOTrainer(agent_model=tiny_model, agents=[tiny_model], reward_func=reward,
                      train_dataset=_data(), args=_config())
    same = MAGRPOTrainer(agent_model=tiny_model, agents=[tiny_model, tiny_model],
                         reward_func=reward, train_dataset=_data(), args=_config())
    assert same.model_name == tiny_model


def test_model_objects_without_tokenizer_are_refused(tiny_model):
    """comlrl 1.4.3: "Tokenizer(s) must be provided when agents are model objects." """
    from transformers import AutoModelForCausalLM

    from comlrl.trainers.reinforce import MAGRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    with pytest.raises(ValueError, match="Tokenizer\\(s\\) must be provided when agents are "
                                         "model objects"):
        MAGRPOTrainer(agents=[model, model], reward_func=reward, train_dataset=_data(),
                      args=_config())


def test_tokenizer_without_pad_token_pads_with_eos(tiny_model):
    """comlrl 1.4.3 (`ensure_pad_token`) sets `pad_token = eos_token` when a tokenizer has
    none, and the trainer builds."""
    from transformers import AutoTokenizer

    from comlrl.trainers.reinforce import MAGRPOTrainer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.pad_token = None
    trainer = MAGRPOTrainer(agent_model=tiny_model, tokenizer=tok, reward_func=reward,
                            train_dataset=_data(), args=_config())
    assert trainer.tokenizer.pad_token == trainer.tokenizer.eos_token == "<|endoftext|>"


# ------------------------------------------------------------------ point 4: order of checks


def test_missing_train_dataset_fails_at_train_not_construction(tiny_model):
    """comlrl 1.4.3 builds the trainer with train_dataset=None; `train()` then raises
    ValueError "Trainer: training requires a train_dataset."."""
    from comlrl.trainers.reinforce import MAGRPOTrainer

    trainer = MAGRPOTrainer(agent_model=tiny_model, reward_func=reward, args=_config())
    with pytest.raises(ValueError, match="Trainer: training requires a train_dataset"):
        trainer.train()


def test_missing_reward_is_reported_before_the_model_is_looked_up(tmp_path):
    """comlrl 1.4.3 with reward_func=None and an agent_model name that cannot be loaded
    reports "reward_func must be a callable." first (it checks the reward before loading)."""
    from comlrl.trainers.reinforce import MAGRPOTrainer

    with pytest.raises(ValueError, match="reward_func must be a callable"):
        MAGRPOTrainer(agent_model=str(tmp_path / "no-such-model"), reward_func=None,
                      train_dataset=_data(), args=_config())


def test_one_agent_accepts_any_joint_mode(tiny_model):
    """comlrl 1.4.3 accepts `joint_mode="cross"` (and any other string) with one agent: a
    single agent has one joint action per sample. With two agents an unknown mode raises
    "Unsupported joint_mode" (comlrl at the first step; here at construction)."""
    from comlrl.trainers.reinforce import MAGRPOTrainer

    def solo(completions):
        return [0.0] * len(completions)

    for mode in ("cross", "aligned", "diagonal"):
        trainer = MAGRPOTrainer(agent_model=tiny_model, num_agents=1, reward_func=solo,
                                train_dataset=_data(), args=_config(joint_mode=mode))
        assert trainer.num_agents == 1
    with pytest.raises(ValueError, match="Unsupported joint_mode"):
        MAGRPOTrainer(agent_model=tiny_model, num_agents=2, reward_func=reward,
                      train_dataset=_data(), args=_config(joint_mode="diagonal"))


# ------------------------------------------------------------------ point 5: train() arguments


def test_train_takes_comlrls_positional_order():
    """comlrl 1.4.3: `train(self, resume_from_checkpoint=None, checkpoint_dir=None,
    checkpoint_interval=1, checkpoint_total_limit=None, **kwargs)`; a bool interval raises
    "checkpoint_interval must be a positive integer."."""
    from comlrl.trainers.reinforce import MAGRPOTrainer

    params = list(inspect.signature(MAGRPOTrainer.train).parameters.values())[1:]
    assert [(p.name, p.default) for p in params[:4]] == [
        ("resume_from_checkpoint", None), ("checkpoint_dir", None),
        ("checkpoint_interval", 1), ("checkpoint_total_limit", None)]
    assert len(params) == 5 and params[4].kind is inspect.Parameter.VAR_KEYWORD


# ------------------------------------------------------------------ points 3, 5, 6 end to end


@pytest.mark.e2e
def test_names_positional_resume_same_wandb_run_and_evaluate(ray_session, tiny_model,
                                                            wandb_dir, tmp_path):
    """The comlrl 1.4.3 flow, end to end:
    - agents given as names train, and `save_model` writes loadable folders;
    - `evaluate()` after `train()` logs `eval/...` into the same W&B run at the env_step
      training reached (comlrl logs into its still-open run at `self.env_step`);
    - a second trainer with the same `wandb_config` (no id, no resume) resumed with
      `train("ckpt/checkpoint-1", "ckpt")` (positionally) continues from the checkpoint, in
      the checkpoint's W&B run: comlrl restores the identity itself (`id` plus
      `resume="allow"`) when `wandb_config` names neither."""
    from transformers import AutoModelForCausalLM

    from comlrl.trainers.reinforce import MAGRPOTrainer
    from comlrl.utils import read_checkpoint_metadata

    ckpt = tmp_path / "ckpt"
    wandb_config = {"project": "comlrl-tests", "name": "compat"}

    def build(epochs):
        return MAGRPOTrainer(agents=[tiny_model, tiny_model], reward_func=reward,
                             train_dataset=_data(), eval_dataset=_data(),
                             args=_config(num_train_epochs=epochs, eval_interval=0,
                                          eval_num_samples=1),
                             wandb_config=dict(wandb_config))

    first = build(1)
    first.train(None, str(ckpt))
    assert first.env_step == 4
    metrics = first.evaluate()
    assert "eval/turn_1/reward_mean" in metrics
    run_id = read_checkpoint_metadata(ckpt / "checkpoint-1")["wandb"]["id"]

    second = build(2)
    second.train(str(ckpt / "checkpoint-1"), str(ckpt))
    assert second.env_step == 8
    assert read_checkpoint_metadata(ckpt / "checkpoint-2")["wandb"]["id"] == run_id
    out = second.save_model(str(tmp_path / "out"))
    assert [os.path.basename(p) for p in out] == ["agent_0", "agent_1"]
    AutoModelForCausalLM.from_pretrained(out[1])

    history = wandb_history(wandb_dir)
    assert {r["_run"].rsplit("-", 1)[1] for r in history} == {run_id}
    train_steps = sorted(r["_step"] for r in history if "turn_1/reward_mean" in r)
    assert train_steps == [4, 8]
    assert [r["_step"] for r in history if "eval/turn_1/reward_mean" in r] == [4]


# ------------------------------------------------------------------ point 9: default resources


@pytest.mark.e2e
@pytest.mark.slow
def test_three_agents_and_two_workers_per_agent_run_with_default_resources(tiny_model):
    """comlrl 1.4.3 trains 3 agents on any machine (one process, agents in turn). Here, with
    every resource setting at its default on this 2-core machine, 3 agents and then 2 agents
    x 2 rollout workers both finish in one process: the local Ray the trainer starts counts
    as many logical CPUs as its actors ask for (3), and is restarted larger when needed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    env.pop("WANDB_SERVICE", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "defaults_script.py"),
                           "--model", tiny_model], env=env, capture_output=True, text=True,
                          timeout=480, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    runs = [line.split() for line in proc.stdout.splitlines() if line.startswith("RUN ")]
    assert [r[1] for r in runs] == ["three-agents", "two-workers-per-agent"]
    # 2 prompts x K=2: 3 agents aligned -> 2 joint actions per prompt, 4 env_steps per run.
    assert [r[2] for r in runs] == ["env_step=4", "env_step=4"]
    assert all(float(r[3].split("=")[1]) >= 3 for r in runs)


def test_resume_of_a_run_that_had_no_wandb_identity_opens_a_run(wandb_dir):
    """A checkpoint written while W&B was off holds no identity; resuming it with a
    `wandb_config` that names no id starts a fresh W&B run instead of failing."""
    from types import SimpleNamespace

    from comlrl.config import MAGRPOConfig
    from comlrl.wandb_run import open_wandb_run

    trainer = SimpleNamespace(wandb_config={"project": "comlrl-tests"}, last_wandb_identity=None,
                              algorithm_name="MAGRPO", num_agents=2, args=MAGRPOConfig())
    run = open_wandb_run(trainer, {"wandb": {}, "last_logged_step": -1, "env_step": 8}, None)
    try:
        assert run.identity and run.identity["id"]
        assert trainer.last_wandb_identity == run.identity
        assert "id" not in trainer.wandb_config
    finally:
        run.finish()
