"""Shared fixtures: the environment every real part needs, a tiny model, one Ray per session."""

from __future__ import annotations

import os
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
