"""Shared fixtures: the environment every real part needs, a tiny model, one Ray per session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Ray on loopback without auth or usage stats; vLLM and W&B never call outside.
TEST_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "TOKENIZERS_PARALLELISM": "false",
}
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


def wandb_history(wandb_dir: Path, run_id: str | None = None) -> list[dict]:
    """Every history record of the offline runs under `wandb_dir` (optionally one run id),
    across all run folders, read back with `wandb leet inspect --json`."""
    base = Path(wandb_dir) / "wandb" if (Path(wandb_dir) / "wandb").is_dir() else Path(wandb_dir)
    records = []
    for run in sorted(base.glob("offline-run-*")):
        if run_id and not run.name.endswith(run_id):
            continue
        files = list(run.glob("*.wandb"))
        if not files:
            continue
        out = subprocess.run([str(Path(sys.executable).parent / "wandb"), "leet", "inspect",
                              "--json", str(files[0])], capture_output=True, text=True, check=True)
        for line in out.stdout.splitlines():
            rec = json.loads(line) if line.startswith("{") else {}
            if rec.get("type") == "history":
                records.append(dict(rec["history"]["item"], _run=run.name))
    return records
