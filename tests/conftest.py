"""Shared fixtures: the environment every real part needs, a tiny model, one Ray per session,
and the runs several test modules compare against (the straight reference, the demo)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.local_env import LOCAL_ENV
from examples.training_curve import wandb_history  # noqa: F401  (tests import it from here)

# Ray on loopback without auth or usage stats; vLLM and W&B never call outside (one definition,
# examples/local_env.py, shared with the benchmarks).
TEST_ENV = dict(LOCAL_ENV)
os.environ.update(TEST_ENV)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from comlrl.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0))


@pytest.fixture(scope="session")
def ray_session():
    """One Ray for the whole session (starting one takes ~7 s)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=512 * 1024 * 1024,
                 runtime_env={"env_vars": dict(TEST_ENV)}, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def wandb_dir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "wandb"
    d.mkdir()
    monkeypatch.setenv("WANDB_DIR", str(d))
    return d


# ---------------------------------------------------------------- runs several modules compare


@pytest.fixture(scope="session")
def straight(tiny_model, tmp_path_factory):
    """The seed example's trainer, 4 epochs in one call, one process (tests/seed_script.py):
    the uninterrupted reference the resume and chaos tests compare against."""
    from tests.test_resume import _env, _run, _seed_cmd

    d = tmp_path_factory.mktemp("straight")
    _run(_seed_cmd(tiny_model, d / "ckpt", 4), _env(d / "wandb"))
    return d


class DemoRun:
    """What one demo run left: the finished process (its console in `output`), its output
    folder, where its training-curve picture should be, and how long it took."""

    def __init__(self, proc: subprocess.CompletedProcess, output_dir: Path, seconds: float):
        self.proc = proc
        self.output_dir = output_dir
        self.png_path = output_dir / "training-curve.png"
        self.seconds = seconds

    @property
    def output(self) -> str:
        """The console as the user sees it: stdout and stderr in the order written."""
        return self.proc.stdout

    @property
    def lines(self) -> list[str]:
        return self.output.splitlines()


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> DemoRun:
    """The README's first command, once per session: `.venv/bin/python examples/resume_demo.py
    --output-dir <tmp>` from the repository root, with the tests' local, offline environment."""
    import time

    output_dir = tmp_path_factory.mktemp("demo") / "resume-demo"
    env = {**os.environ, **TEST_ENV}
    for inherited in ("WANDB_DIR", "WANDB_SERVICE", "RAY_ADDRESS", "COMLRL_MODEL",
                      "COMLRL_OUTPUT"):
        env.pop(inherited, None)  # the demo decides these itself, as on a user's machine
    venv_python = ROOT / ".venv" / "bin" / "python"
    python = venv_python if venv_python.exists() else Path(sys.executable)
    start = time.monotonic()
    proc = subprocess.run([str(python), "examples/resume_demo.py", "--output-dir",
                           str(output_dir)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900,
                          start_new_session=True)
    return DemoRun(proc, output_dir, time.monotonic() - start)
