"""workers.cli: config loading, overrides, errors that name the key, resume selection, callables.

All fast: nothing here starts Ray, an engine or W&B.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest

from workers import cli

ROOT = Path(__file__).resolve().parents[1]
SEED_CONFIG = ROOT / "examples" / "seed_config.yaml"


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent(text))
    return path


MINIMAL = """
    dataset: ["Say hi:", "Say bye:"]
    reward_func: examples.rewards:length_ratio_reward
"""


# ---------------------------------------------------------------- overrides


def test_parse_override_reads_yaml_scalars():
    assert cli.parse_override("magrpo.num_train_epochs=4") == (["magrpo", "num_train_epochs"], 4)
    assert cli.parse_override("magrpo.temperature=0.9")[1] == 0.9
    assert cli.parse_override("magrpo.verbose=false")[1] is False
    assert cli.parse_override("checkpoint_total_limit=null")[1] is None
    assert cli.parse_override("wandb.tags=[a, b]")[1] == ["a", "b"]
    assert cli.parse_override("output_dir=/tmp/a=b")[1] == "/tmp/a=b"  # first '=' splits
    assert cli.parse_override("wandb.name=run: 7")[1] == "run: 7"  # not YAML: kept as text
    for bad in ("magrpo.num_train_epochs", "=4", "magrpo..x=1"):
        with pytest.raises(cli.ConfigError, match="not key=value"):
            cli.parse_override(bad)


def test_apply_overrides_nests_and_leaves_the_original_alone():
    raw = {"model": "tiny", "magrpo": {"num_turns": 1}}
    out = cli.apply_overrides(raw, ["magrpo.num_train_epochs=4", "wandb.project=p",
                                    "model.tiny.hidden_size=64"])
    assert out["magrpo"] == {"num_turns": 1, "num_train_epochs": 4}
    assert out["wandb"] == {"project": "p"}
    assert out["model"] == {"tiny": {"hidden_size": 64}}
    assert raw == {"model": "tiny", "magrpo": {"num_turns": 1}}
    with pytest.raises(cli.ConfigError, match="num_agents is 2, not a mapping"):
        cli.apply_overrides({"num_agents": 2}, ["num_agents.x=1"])


def test_seed_config_loads_with_overrides(tmp_path):
    job = cli.load_job_config(SEED_CONFIG, [f"output_dir={tmp_path}",
                                            "magrpo.num_train_epochs=6"])
    assert job.model == "tiny" and job.num_agents == 2 and len(job.dataset) == 4
    assert job.magrpo == {"num_turns": 1, "num_train_epochs": 6, "num_generations": 4,
                          "max_new_tokens": 64, "logging_steps": 1}
    assert job.output_dir == str(tmp_path)
    assert job.checkpoint_dir == str(tmp_path / "checkpoints")
    assert job.checkpoint_interval == 1


def test_output_and_checkpoint_dirs_resolve(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = write_config(tmp_path, MINIMAL)
    job = cli.load_job_config(cfg)
    assert job.output_dir == str(tmp_path / "runs" / "job")
    assert job.checkpoint_dir == str(tmp_path / "runs" / "job" / "checkpoints")
    job = cli.load_job_config(cfg, ["checkpoint_dir=ck", "output_dir=out"])
    assert job.checkpoint_dir == str(tmp_path / "out" / "ck")
    job = cli.load_job_config(cfg, [f"checkpoint_dir={tmp_path / 'abs'}"])
    assert job.checkpoint_dir == str(tmp_path / "abs")


# ---------------------------------------------------------------- errors that name the key


@pytest.mark.parametrize("override, named", [
    ("bogus=1", "'bogus'"),
    ("checkpoint_intervall=2", "did you mean 'checkpoint_interval'"),
    ("magrpo.num_train_epoch=4", "'magrpo.num_train_epoch'"),
    ("wandb.projcet=x", "did you mean 'project'"),
    ("model.tiny.hiden_size=64", "'model.tiny.hiden_size'"),
])
def test_unknown_key_is_named(tmp_path, override, named):
    with pytest.raises(cli.ConfigError, match="unknown config key") as err:
        cli.load_job_config(write_config(tmp_path, MINIMAL), [override])
    assert named in str(err.value)


def test_invalid_values_are_named(tmp_path):
    cfg = write_config(tmp_path, MINIMAL)
    with pytest.raises(cli.ConfigError, match="magrpo: "):
        cli.load_job_config(cfg, ["magrpo.num_train_epochs=many"])
    with pytest.raises(cli.ConfigError, match="magrpo: num_generations must be >= 2"):
        cli.load_job_config(cfg, ["magrpo.num_generations=1"])
    with pytest.raises(cli.ConfigError, match="checkpoint_interval must be an integer >= 1"):
        cli.load_job_config(cfg, ["checkpoint_interval=0"])
    with pytest.raises(cli.ConfigError, match="magrpo.num_agents=3 disagrees"):
        cli.load_job_config(cfg, ["magrpo.num_agents=3"])
    with pytest.raises(cli.ConfigError, match="'reward_func' is required"):
        cli.load_job_config(write_config(tmp_path, "dataset: [a]\n"))
    with pytest.raises(cli.ConfigError, match="must be a YAML mapping"):
        cli.load_job_config(write_config(tmp_path, "- a\n- b\n"))


def test_main_reports_errors_and_prints_config(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([str(SEED_CONFIG), "magrpo.num_train_epoch=4"])
    assert exit_.value.code == 2
    assert "unknown config key 'magrpo.num_train_epoch'" in capsys.readouterr().err
    # Options may come before, between or after the overrides.
    assert cli.main(["--print-config", str(SEED_CONFIG), f"output_dir={tmp_path}",
                     "--resume", "latest", "magrpo.seed=7"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["magrpo"]["seed"] == 7 and printed["output_dir"] == str(tmp_path)


# ---------------------------------------------------------------- resume selection


def _fake_checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "metadata.json").write_text(json.dumps({
        "format": "comlrl-split-checkpoint", "format_version": 1, "env_step": 8,
        "wandb": {"id": "abc123", "project": "p", "entity": "", "name": "n"}}))
    return folder


def test_resume_latest_picks_the_newest_whole_checkpoint(tmp_path):
    ckpts = tmp_path / "ck"
    assert cli.resolve_resume("latest", str(ckpts)) is None  # no folder yet: start fresh
    ckpts.mkdir()
    assert cli.resolve_resume("latest", str(ckpts)) is None
    for n in (1, 2, 10):
        _fake_checkpoint(ckpts / f"checkpoint-{n}")
    (ckpts / ".staging-checkpoint-11").mkdir()  # half-written: never picked
    (ckpts / "checkpoint-x").mkdir()
    (ckpts / "checkpoint-12").write_text("a file, not a checkpoint")
    assert cli.resolve_resume("latest", str(ckpts)) == ckpts / "checkpoint-10"
    assert cli.resolve_resume(None, str(ckpts)) is None
    assert cli.resolve_resume(str(ckpts / "checkpoint-2"), "unused") == ckpts / "checkpoint-2"
    with pytest.raises(cli.ConfigError, match="no such checkpoint folder"):
        cli.resolve_resume(str(ckpts / "checkpoint-99"), str(ckpts))


def test_resume_merges_the_wandb_identity(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_DIR", raising=False)
    job = cli.load_job_config(SEED_CONFIG, [f"output_dir={tmp_path}"])
    fresh = cli.wandb_config_for(job, None)
    assert fresh == {"project": "comlrl-examples", "name": "resume-demo", "dir": str(tmp_path)}
    ckpt = _fake_checkpoint(tmp_path / "checkpoints" / "checkpoint-1")
    resumed = cli.wandb_config_for(job, ckpt)
    assert resumed == {"project": "p", "name": "n", "dir": str(tmp_path), "id": "abc123",
                       "entity": "", "resume": "allow"}
    job.wandb = None
    assert cli.wandb_config_for(job, ckpt) is None


# ---------------------------------------------------------------- callables and datasets


def test_reward_module_function_loads(monkeypatch):
    monkeypatch.chdir(ROOT)
    reward = cli.load_callable("examples.rewards:length_ratio_reward")
    assert reward(["ab", "ab"], ["abcde", "ab"]) == [1.0, pytest.approx(math.exp(-1))]
    by_path = cli.load_callable("examples/rewards.py:length_ratio_reward")
    # Same module name either way, so the checkpoint's reward fingerprint matches on resume.
    assert by_path.__module__ == "examples.rewards"


def test_reward_file_outside_the_working_dir_loads(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    f = tmp_path / "my_reward.py"
    f.write_text("def score(a, b):\n    return [float(len(x) + len(y)) for x, y in zip(a, b)]\n")
    reward = cli.load_callable(f"{f}:score")
    assert reward(["a"], ["bc"]) == [3.0] and reward.__module__ == "my_reward"


@pytest.mark.parametrize("spec, message", [
    ("length_ratio_reward", "must be 'module:function'"),
    ("examples.rewards:", "give both the module"),
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("examples.rewards:missing", "has no attribute 'missing' (callables there: "
                                 "length_ratio_reward)"),
    ("examples.rewards:math", "'math' is a module, not a function"),
    ("examples/no_such_file.py:f", "file examples/no_such_file.py not found"),
    (None, "must be 'module:function'"),
])
def test_bad_reward_spec_is_explained(monkeypatch, spec, message):
    monkeypatch.chdir(ROOT)
    with pytest.raises(cli.ConfigError) as err:
        cli.load_callable(spec)
    assert message in str(err.value) and str(err.value).startswith("reward_func")


def test_non_callable_attribute_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "consts.py").write_text("SCALE = 3\n")
    with pytest.raises(cli.ConfigError, match="'SCALE' is a int, not a function"):
        cli.load_callable("consts:SCALE")


def test_dataset_forms(tmp_path):
    assert cli.load_rows(["a", {"prompt": "b", "x": 1}]) == [{"prompt": "a"},
                                                              {"prompt": "b", "x": 1}]
    with pytest.raises(cli.ConfigError, match="'prompt' key"):
        cli.load_rows([{"text": "a"}])
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    ds = cli.load_rows(str(f))
    assert ds.column_names == ["prompt"] and ds["prompt"] == ["one", "two"]
    with pytest.raises(cli.ConfigError, match="missing.jsonl not found"):
        cli.load_rows(str(tmp_path / "missing.jsonl"))


def test_tiny_model_spec():
    assert cli.tiny_kwargs("tiny") == {}
    assert cli.tiny_kwargs({"tiny": {"seed": 3}}) == {"seed": 3}
    assert cli.tiny_kwargs({"tiny": None}) == {}
    assert cli.tiny_kwargs("/models/qwen") is None
    with pytest.raises(cli.ConfigError, match="mapping"):
        cli.tiny_kwargs({"path": "x"})


def test_resume_latest_passes_over_a_damaged_newest_checkpoint(tmp_path, capfd):
    """`--resume latest` on a folder whose newest checkpoint was damaged (a file changed after
    it was written) resumes from the one before, with a warning naming the damaged one, so an
    automatically resubmitted job does not fail forever."""
    from comlrl.checkpoint import begin_staging, commit_checkpoint
    from workers.cli import resolve_resume

    for epoch in (1, 2):
        staging = begin_staging(tmp_path, epoch, "run-1")
        (staging / "agent_0").mkdir()
        (staging / "agent_0" / "model.safetensors").write_bytes(b"weights %d" % epoch)
        commit_checkpoint(staging, {"run_uid": "run-1", "env_step": 8 * epoch,
                                    "epoch": epoch})
    (tmp_path / "checkpoint-2" / "agent_0" / "model.safetensors").write_bytes(b"garbage")
    chosen = resolve_resume("latest", str(tmp_path))
    assert chosen == tmp_path / "checkpoint-1"
    said = "".join(capfd.readouterr())
    assert f"skipping damaged {tmp_path / 'checkpoint-2'}" in said, said
