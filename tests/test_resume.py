"""Checkpoints and resume: same W&B run, bit-identical curves and weights, even after kill -9.

Each run is its own process (its own local Ray), like a user's job, via tests/seed_script.py
and examples/resume_demo.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from comlrl.checkpoint import CheckpointError, read_checkpoint_metadata, verify_checksums
from examples.rewards import length_ratio_reward
from tests.conftest import ROOT, wandb_history

pytestmark = pytest.mark.e2e

# Values that must match between runs (timings and throughput naturally differ).
COMPARED = ("turn_1/reward_mean", "turn_1/expected_return", "agent_0/loss", "agent_1/loss",
            "agent_0/completion_length", "agent_1/completion_length",
            "agent_0/policy_version", "agent_1/policy_version", "train/epoch")


def _env(wandb_dir: Path, **extra: str) -> dict:
    env = {**os.environ, "WANDB_DIR": str(wandb_dir), "PYTHONPATH": str(ROOT), **extra}
    env.pop("RAY_ADDRESS", None)
    # An in-process W&B run earlier in this pytest process exported WANDB_SERVICE; a child
    # that inherits it joins that service instead of starting its own, and hangs once a
    # killed sibling has left the service in a bad state.
    env.pop("WANDB_SERVICE", None)
    return env


def _seed_cmd(model, ckpt, epochs, resume=None, *overrides):
    cmd = [sys.executable, str(ROOT / "tests" / "seed_script.py"), "--model", model,
           "--checkpoint-dir", str(ckpt), "--epochs", str(epochs)]
    if resume:
        cmd += ["--resume", str(resume)]
    for o in overrides:
        cmd += ["--override", o]
    return cmd


def _run(cmd, env, timeout=420):
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _by_step(history, compared=COMPARED):
    out = {}
    for rec in history:
        assert rec["_step"] not in out, f"env_step {rec['_step']} logged twice"
        out[rec["_step"]] = {k: rec[k] for k in compared if k in rec}
    return out


def _assert_same_curves(ckpt: Path, wandb_dir: Path, straight_wandb: Path,
                        compared=COMPARED) -> dict:
    """The run whose newest checkpoint is ckpt/checkpoint-4 logged, into one W&B run under
    `wandb_dir`, every env_step once with exactly the `compared` values of the straight
    run's; returns its values by step."""
    run_id = read_checkpoint_metadata(ckpt / "checkpoint-4")["wandb"]["id"]
    got = _by_step(wandb_history(wandb_dir, run_id), compared)
    want = _by_step(wandb_history(straight_wandb), compared)
    assert sorted(got) == sorted(want)
    for step in want:
        assert got[step] == want[step], step
    return got


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _same_weights(a: Path, b: Path) -> None:
    for agent in ("agent_0", "agent_1"):
        wa, wb = _weights(a / agent), _weights(b / agent)
        assert wa.keys() == wb.keys()
        for k in wa:
            assert (wa[k] == wb[k]).all(), f"{agent} {k} differs"


@pytest.fixture(scope="module")
def seed_example(demo_run):
    """examples/resume_demo.py as written: 2 epochs, then resume to 4 in a new trainer (the
    session's one demo run, tests/conftest.py)."""
    assert demo_run.proc.returncode == 0, demo_run.output[-6000:]
    return demo_run.output_dir, demo_run.proc


def test_seed_example_runs_as_written_into_one_wandb_run(seed_example):
    d, proc = seed_example
    ckpt = d / "checkpoints" / "resume-demo"
    assert sorted(p.name for p in ckpt.glob("checkpoint-*")) == \
        ["checkpoint-1", "checkpoint-2", "checkpoint-3", "checkpoint-4"]
    meta = read_checkpoint_metadata(ckpt / "checkpoint-4")
    assert meta["env_step"] == 64 and meta["epoch"] == 4
    assert set(meta["wandb"]) == {"id", "project", "entity", "name"}
    assert meta["wandb"]["project"] == "comlrl-examples" and meta["wandb"]["name"] == "resume-demo"
    run_id = meta["wandb"]["id"]
    assert read_checkpoint_metadata(ckpt / "checkpoint-2")["wandb"]["id"] == run_id
    folders = sorted((d / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(folders) == 2, "both halves log to the same run id"
    history = wandb_history(d, run_id)
    assert sorted(_by_step(history)) == list(range(8, 65, 8))


def test_split_run_matches_straight_run_bit_for_bit(straight, seed_example, tiny_model):
    d, _ = seed_example
    s_hist = _by_step(wandb_history(straight / "wandb"))
    e_hist = _by_step(wandb_history(d))
    assert sorted(s_hist) == sorted(e_hist) == list(range(8, 65, 8))
    for step in s_hist:
        assert s_hist[step] == e_hist[step], step        # exact equality, no tolerance
    _same_weights(straight / "ckpt" / "checkpoint-4",
                  d / "checkpoints" / "resume-demo" / "checkpoint-4")


class _Watcher(threading.Thread):
    """Polls checkpoint_dir: every folder named checkpoint-N must be whole when seen."""

    def __init__(self, ckpt: Path):
        super().__init__(daemon=True)
        self.ckpt, self.stop, self.seen, self.problems = ckpt, False, set(), []

    def run(self):
        while not self.stop:
            for p in list(self.ckpt.glob("checkpoint-*")) if self.ckpt.exists() else []:
                if p.name in self.seen:
                    continue
                try:
                    verify_checksums(p)
                    self.seen.add(p.name)
                except (CheckpointError, FileNotFoundError) as exc:
                    if p.exists():  # pruned between glob and read is fine
                        self.problems.append(f"{p.name}: {exc}")
            time.sleep(0.02)


def _journal_step(ckpt: Path) -> int:
    try:
        return json.loads((ckpt / "wandb-journal.json").read_text())["last_step"]
    except (OSError, ValueError, KeyError):
        return -1


@pytest.mark.parametrize("layout", [("colocate=False",), ("colocate=True",)],
                         ids=["split", "colocated"])
def test_kill_9_in_epoch_3_then_resume_matches_straight_run(straight, tiny_model, tmp_path,
                                                            layout):
    """kill -9 of the whole run in epoch 3, then a resume from checkpoint-2 in a new process,
    in each layout: every env_step logged once into the same W&B run, with exactly the values
    and final weights of the uninterrupted run (`straight`, the default layout: colocated on
    this local CPU run). So the split and colocated layouts also compute the same values."""
    ckpt = tmp_path / "ckpt"
    env = _env(tmp_path / "wandb")
    watcher = _Watcher(ckpt)
    watcher.start()
    proc = subprocess.Popen(_seed_cmd(tiny_model, ckpt, 4, None, *layout), env=env,
                            start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while _journal_step(ckpt) < 40 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert _journal_step(ckpt) in (40, 48), "expected to stop part-way through epoch 3"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        time.sleep(2)  # let orphaned W&B/Ray helpers notice, then clear the process group
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert sorted(p.name for p in ckpt.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    _run(_seed_cmd(tiny_model, ckpt, 4, ckpt / "checkpoint-2", *layout), env)
    watcher.stop = True
    watcher.join()
    assert not watcher.problems, watcher.problems
    assert watcher.seen == {f"checkpoint-{i}" for i in range(1, 5)}

    run_id = read_checkpoint_metadata(ckpt / "checkpoint-4")["wandb"]["id"]
    assert len(list((tmp_path / "wandb" / "wandb").glob(f"offline-run-*-{run_id}"))) == 2
    history = wandb_history(tmp_path / "wandb", run_id)
    got = _by_step(history)  # asserts no env_step twice across the two run files
    want = _by_step(wandb_history(straight / "wandb"))
    assert sorted(got) == sorted(want)
    for step in want:
        assert got[step] == want[step], step
    _same_weights(straight / "ckpt" / "checkpoint-4", ckpt / "checkpoint-4")


def test_gradient_checkpointing_changes_no_value_and_may_change_on_resume(straight, tiny_model,
                                                                         tmp_path):
    """Epochs 1-2 with gradient_checkpointing=True, then a resume from checkpoint-2 without it
    to 4 epochs: every logged value and the final weights are those of the uninterrupted
    default run (`straight`), so the setting trades memory for compute only and a resume may
    change it (RESUMABLE_FIELDS). comlrl 1.4.3 has no such setting (its MAGRPOConfig raises
    TypeError "unexpected keyword argument 'gradient_checkpointing'")."""
    ckpt = tmp_path / "ckpt"
    env = _env(tmp_path / "wandb")
    _run(_seed_cmd(tiny_model, ckpt, 2, None, "gradient_checkpointing=True"), env)
    _run(_seed_cmd(tiny_model, ckpt, 4, ckpt / "checkpoint-2"), env)
    got = _assert_same_curves(ckpt, tmp_path / "wandb", straight / "wandb")
    assert sorted(got) == list(range(8, 65, 8))
    _same_weights(straight / "ckpt" / "checkpoint-4", ckpt / "checkpoint-4")


def test_a_checkpoint_resumes_in_the_split_layout_and_its_warm_actors_start_over(
        straight, tiny_model, tmp_path):
    """A copy of the straight run's checkpoint-2 (the default layout, colocated here)
    resumed with colocate=False (the field may change on resume: it moves work, never
    changes it), then, in the same process, a fresh trainer of the same settings on the split
    actors the first train() parked. Both log exactly the straight run's values at every
    env_step and end with its weights. (The demo and
    `test_a_fresh_run_on_warm_actors_computes_what_new_actors_do` reuse colocated hosts.)"""
    import shutil

    ckpt, again = tmp_path / "ckpt", tmp_path / "again"
    shutil.copytree(straight / "ckpt" / "checkpoint-2", ckpt / "checkpoint-2")
    env = _env(tmp_path / "wandb")
    proc = _run(_seed_cmd(tiny_model, ckpt, 4, ckpt / "checkpoint-2", "colocate=False") +
                ["--again", str(again)], env)
    assert "actors started: 2 rollout workers, 2 learners, 1 checkpointer" in proc.stdout
    assert "reused from the previous train(): 2 rollout workers, 2 learners" in proc.stdout
    want = _by_step(wandb_history(straight / "wandb"))
    resumed_id = read_checkpoint_metadata(ckpt / "checkpoint-4")["wandb"]["id"]
    assert resumed_id == read_checkpoint_metadata(straight / "ckpt" / "checkpoint-4")[
        "wandb"]["id"]
    resumed = _by_step(wandb_history(tmp_path / "wandb", resumed_id))
    assert sorted(resumed) == [40, 48, 56, 64]
    fresh = _by_step(wandb_history(
        tmp_path / "wandb", read_checkpoint_metadata(again / "checkpoint-4")["wandb"]["id"]))
    assert sorted(fresh) == sorted(want)
    for step in want:
        assert fresh[step] == want[step], step           # exact equality, no tolerance
        if step in resumed:
            assert resumed[step] == want[step], step
    _same_weights(straight / "ckpt" / "checkpoint-4", ckpt / "checkpoint-4")
    _same_weights(straight / "ckpt" / "checkpoint-4", again / "checkpoint-4")


def test_kill_while_checkpoint_is_written_keeps_earlier_ones(tiny_model, tmp_path):
    ckpt = tmp_path / "ckpt"
    env = _env(tmp_path / "wandb")
    cmd = _seed_cmd(tiny_model, ckpt, 2, None, "max_new_tokens=8") + \
        ["--pause-before-publish", "3"]
    proc = subprocess.Popen(cmd, env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        staging = ckpt / ".staging-checkpoint-2"
        while not (staging / "metadata.json").exists() and time.time() < deadline:
            assert proc.poll() is None, "run ended before checkpoint-2 was staged"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert staging.exists() and not (ckpt / "checkpoint-2").exists()
    assert [p.name for p in ckpt.glob("checkpoint-*")] == ["checkpoint-1"]
    verify_checksums(ckpt / "checkpoint-1")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpt / "checkpoint-1" / "agent_0")
    # The next run cleans the staging folder and finishes the run.
    _run(_seed_cmd(tiny_model, ckpt, 2, ckpt / "checkpoint-1", "max_new_tokens=8"),
         _env(tmp_path / "wandb"))
    assert not staging.exists()
    assert sorted(p.name for p in ckpt.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]


# ------------------------------------------------------------------ refused resumes


def _trainer(tiny_model, **changes):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    settings = dict(num_turns=1, num_train_epochs=4, num_generations=4, max_new_tokens=64,
                    logging_steps=1)
    settings.update(changes.pop("config", {}))
    model = changes.pop("model", tiny_model)
    kwargs = dict(
        agents=[AutoModelForCausalLM.from_pretrained(model) for _ in range(2)],
        tokenizer=AutoTokenizer.from_pretrained(model), reward_func=length_ratio_reward,
        train_dataset=Dataset.from_dict({"prompt": [
            "Describe a city in the clouds:", "Invent a new holiday and explain it:",
            "Write a bedtime story for a dragon:", "Design a playground on Mars:"]}),
        args=MAGRPOConfig(**settings))
    kwargs.update(changes)
    return MAGRPOTrainer(**kwargs)


def _other_model(tmp_path_factory):
    from comlrl.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("other") / "m", seed=1))


@pytest.mark.parametrize("change,needle", [
    ({"config": {"num_generations": 8}}, "config.num_generations: checkpoint has 4, this run has 8"),
    ({"config": {"agent_learning_rate": 1e-4}}, "config.agent_learning_rate: checkpoint has 5e-06"),
    ({"config": {"seed": 7}}, "config.seed: checkpoint has 42, this run has 7"),
    ({"config": {"max_new_tokens": 32}}, "config.max_new_tokens: checkpoint has 64"),
    ({"reward_func": lambda c1, c2: [0.0] * len(c1)}, "reward_func: checkpoint has"),
    ("dataset", "dataset: checkpoint has '4 rows:"),
    ("model", "models: checkpoint has"),
    ("tokenizer", "tokenizers: checkpoint has"),
])
def test_resume_refuses_a_changed_setting(straight, tiny_model, tmp_path_factory, change, needle):
    from datasets import Dataset
    from transformers import AutoTokenizer

    if change == "dataset":
        change = {"train_dataset": Dataset.from_dict({"prompt": ["a", "b", "c", "d"]})}
    elif change == "model":
        change = {"model": _other_model(tmp_path_factory),
                  "tokenizer": AutoTokenizer.from_pretrained(tiny_model)}
    elif change == "tokenizer":
        tok = AutoTokenizer.from_pretrained(tiny_model)
        tok.add_tokens(["<extra>"])
        change = {"tokenizer": tok}
    trainer = _trainer(tiny_model, **change)
    d = tmp_path_factory.mktemp("refuse")
    with pytest.raises(ValueError, match="cannot resume") as info:
        trainer.train(resume_from_checkpoint=str(straight / "ckpt" / "checkpoint-2"),
                      checkpoint_dir=str(d / "ckpt"))
    assert needle in str(info.value)
    assert "Only num_train_epochs" in str(info.value)


def test_foreign_checkpoint_dir_is_refused(straight, tiny_model):
    trainer = _trainer(tiny_model)
    with pytest.raises(ValueError, match="already holds checkpoints of another run"):
        trainer.train(checkpoint_dir=str(straight / "ckpt"))


def test_a_folder_that_is_not_a_checkpoint_is_refused(tiny_model, tmp_path):
    (tmp_path / "not-ours").mkdir()
    (tmp_path / "not-ours" / "metadata.json").write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="is not a comlrl-split checkpoint"):
        _trainer(tiny_model).train(resume_from_checkpoint=str(tmp_path / "not-ours"))
    with pytest.raises(ValueError, match="has no metadata.json"):
        _trainer(tiny_model).train(resume_from_checkpoint=str(tmp_path))


def test_changed_file_is_caught_by_its_checksum(straight, tiny_model, tmp_path, wandb_dir):
    """A resume verifies every file of its checkpoint (in parallel, while the driver saves
    the models and W&B reads the run's files) and refuses a changed one before anything
    starts: the error names the file, nothing is written into checkpoint_dir, no W&B run
    starts (W&B waits for the checks) and the models' temporary folder is gone.
    comlrl 1.4.3 (its venv, 0.43M model, 8 bytes zeroed mid-way through its one
    training_state.pt) resumed without any error: it records no file hashes (README,
    Differences)."""
    import shutil
    import tempfile

    copy = tmp_path / "checkpoint-2"
    shutil.copytree(straight / "ckpt" / "checkpoint-2", copy)
    with open(copy / "agent_1" / "model.safetensors", "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"\x00" * 8)
    with pytest.raises(ValueError, match="agent_1/model.safetensors changed since it was written"):
        verify_checksums(copy)
    def model_folders():  # Session's temporary folders (not the shared comlrl-split-logs)
        return {p for p in Path(tempfile.gettempdir()).glob("comlrl-split-*")
                if p.name != "comlrl-split-logs"}

    before = model_folders()
    with pytest.raises(CheckpointError,
                       match="agent_1/model.safetensors changed since it was written"):
        _trainer(tiny_model, wandb_config={"project": "p"}).train(
            resume_from_checkpoint=str(copy), checkpoint_dir=str(tmp_path / "ckpt"))
    assert not list((tmp_path / "ckpt").glob("*checkpoint-*"))
    assert model_folders() <= before
    assert not list(wandb_dir.rglob("*run-*")), "a W&B run started before the checks"
    # The same resume from an intact copy does start W&B there (so the check above can fail).
    shutil.copy(straight / "ckpt" / "checkpoint-2" / "agent_1" / "model.safetensors",
                copy / "agent_1" / "model.safetensors")
    _trainer(tiny_model, wandb_config={"project": "p"}, config={"num_train_epochs": 3}).train(
        resume_from_checkpoint=str(copy), checkpoint_dir=str(tmp_path / "ckpt"))
    assert list(wandb_dir.rglob("*run-*"))


def test_checkpoint_agent_folder_loads_with_from_pretrained(straight, tiny_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.roles.learner import Learner

    ckpt = straight / "ckpt" / "checkpoint-4"
    model = AutoModelForCausalLM.from_pretrained(ckpt / "agent_0")
    tok = AutoTokenizer.from_pretrained(ckpt / "agent_0")
    assert tok.eos_token == "<|endoftext|>"
    # The learner restored from the same folder computes the same logits.
    learner = Learner(0, tiny_model, learning_rate=1e-3, train_batch_size=2)
    learner.load(str(ckpt / "agent_0"))
    ids = [[5, 6, 7, 8, 9, 10]]
    with torch.no_grad():
        want = model(torch.tensor(ids)).logits
        assert torch.equal(want, learner.model(torch.tensor(ids)).logits)
    meta = read_checkpoint_metadata(ckpt)
    assert meta["policy_versions"] == [8, 8] and learner.version == 8


def test_a_fresh_run_on_warm_actors_computes_what_new_actors_do(straight, tiny_model,
                                                                  tmp_path):
    """Two fresh train() calls of one process, checkpointing beside each other: the second
    takes the actors the first parked (workers/driver/actors.py), its learners start over from the
    initial model (`Learner.reinit`) and it logs, step for step, exactly what the straight
    run logged in new actors of its own process; the weights of both checkpoints match too."""
    d = tmp_path
    proc = _run(_seed_cmd(tiny_model, d / "runs" / "first", 2) + ["--again",
                str(d / "runs" / "second")], _env(d / "wandb"))
    out = proc.stdout + proc.stderr
    assert out.count("actors started: ") == 1 and \
        out.count("actors reused from the previous train(): ") == 1, out[-3000:]
    reference = {step: values for step, values in
                 _by_step(wandb_history(straight / "wandb")).items() if step <= 32}
    for name in ("first", "second"):
        ckpt = d / "runs" / name
        run_id = read_checkpoint_metadata(ckpt / "checkpoint-2")["wandb"]["id"]
        assert _by_step(wandb_history(d / "wandb", run_id)) == reference, name
        _same_weights(straight / "ckpt" / "checkpoint-2", ckpt / "checkpoint-2")
