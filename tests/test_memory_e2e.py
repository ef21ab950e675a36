"""Memory: the final weights reach the user's models without a second copy (mapped from the
last checkpoint, or streamed a bucket at a time), in a start-then-resume; a run that will not
fit is refused before it starts (issue 34)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_train_e2e import make_trainer

pytestmark = pytest.mark.e2e

BUCKET = 2 * 1024 * 1024
"""The pull-back's bucket in this test: the 10M model's 40 MB are 20 buckets here."""


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the peak since the last reset) of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak(pid: int) -> None:
    """Start the process's VmHWM over from its RSS now (Linux: clear_refs 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def _shared() -> int:
    """Shared memory in use on the machine (/proc/meminfo Shmem: tmpfs files and Ray's object
    store, the two places a copy outside any process's heap would land), bytes. Unlike
    MemTotal - MemAvailable it does not move when some Ray process starts or exits."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "Shmem":
            return int(value.split()[0]) * 1024
    raise AssertionError("no Shmem in /proc/meminfo")


class _SharedPeak:
    """The most shared memory in use above the start, sampled every millisecond while the
    block runs: the tmpfs files and object-store bytes no process's RSS shows."""

    def __enter__(self):
        import threading

        self.start, self.peak, self.stop = _shared(), 0, threading.Event()

        def sample():
            while not self.stop.wait(0.001):
                self.peak = max(self.peak, _shared() - self.start)

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, _shared() - self.start)


@pytest.fixture(scope="module")
def ten_m_model(tmp_path_factory) -> str:
    from comlrl.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "10m", seed=0,
                                hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4,
                                intermediate_size=1024))


def test_final_weights_come_back_without_a_second_copy_in_a_start_then_resume(
        ray_session, ten_m_model, wandb_dir, tmp_path, monkeypatch):
    """How the final weights reach the user's models, and what that costs in memory.

    With checkpoints (a start, then a resume): the last checkpoint holds exactly the final
    weights, so each agent's weights are mapped from its safetensors file: the driver's and
    each learner's peak memory, and the machine's shared memory (tmpfs, object store), grow
    by less than a fifth of one model meanwhile, the bucketed pull never runs, and the models
    hold exactly that checkpoint's weights. Without a checkpoint: the pull streams 2 MiB
    buckets through two tmpfs files: each learner's peak grows by less than a quarter of the
    model's bytes, the machine's shared memory by less than half a model, and the driver's
    peak by less than the two models' new memory plus a quarter of a model (one export of
    the whole state dict into the object store grew each learner and the object store by a
    whole model per agent, and was where Ray killed the 358M seed run). Colocated hosts, the
    layout of a local run. Processes are measured by their own peaks (VmHWM), not by the
    machine's MemAvailable: that moved by 15 MB in CI while some other Ray process ran."""
    import os

    import ray
    import torch
    from safetensors.torch import load_file

    import workers.driver.hand_back as learner_module
    import workers.driver.session as session_module

    monkeypatch.setattr(learner_module, "PULL_BUCKET_BYTES", BUCKET)
    original_pull, original_session_pull = learner_module.pull_weights, \
        session_module.Session.pull_weights
    pulls: list[dict] = []             # one per bucketed pull (no checkpoint to map)
    maps: list[dict] = []              # one per Session.pull_weights

    def peaks(learners, run) -> dict:
        """Each process's peak growth over its RSS before, and the shared memory's."""
        pids = [os.getpid()] + [ray.get(learner.node_info.remote())["pid"]
                                for learner in learners]
        before = {}
        for pid in pids:
            _reset_peak(pid)
            before[pid] = _status(pid)["VmRSS"]
        with _SharedPeak() as shared:
            run()
        grew = {pid: _status(pid)["VmHWM"] - before[pid] for pid in pids}
        return {"driver": grew[pids[0]], "learners": [grew[pid] for pid in pids[1:]],
                "shared": shared.peak}

    def measured(learners, models, bucket_bytes=None):
        pulls.append(peaks(learners, lambda: original_pull(learners, models, bucket_bytes)))

    def session_pull(self):
        maps.append(peaks(self.learners, lambda: original_session_pull(self)))

    monkeypatch.setattr(session_module, "pull_weights", measured)   # bound there by name
    monkeypatch.setattr(session_module.Session, "pull_weights", session_pull)
    ckpt = tmp_path / "ckpt"
    first = make_trainer(ten_m_model, num_train_epochs=1, colocate=True)
    first.train(checkpoint_dir=str(ckpt), checkpoint_interval=1)
    second = make_trainer(ten_m_model, num_train_epochs=2, colocate=True)
    second.train(checkpoint_dir=str(ckpt), checkpoint_interval=1,
                 resume_from_checkpoint=str(ckpt / "checkpoint-1"))
    size = sum(p.numel() * p.element_size() for p in first.agents[0].parameters())
    assert size > 35e6
    assert pulls == [] and len(maps) == 2                    # mapped, never pulled
    for grown in maps:
        assert len(grown["learners"]) == 2
        for value in [grown["driver"], grown["shared"], *grown["learners"]]:
            assert value < size / 5, (grown, size)
    for trainer, checkpoint in ((first, "checkpoint-1"), (second, "checkpoint-2")):
        for i, agent in enumerate(trainer.agents):
            saved = load_file(str(ckpt / checkpoint / f"agent_{i}" / "model.safetensors"))
            state = agent.state_dict()
            assert saved.keys() == state.keys()
            for name, value in saved.items():
                assert torch.equal(state[name], value), (checkpoint, i, name)
    # No checkpoint: the bucketed pull, from the learners' live state.
    third = make_trainer(ten_m_model, num_train_epochs=1, colocate=True)
    third.train()
    assert len(pulls) == 1 and len(maps) == 3                # one pull, of two learners
    (grown,) = pulls
    assert len(grown["learners"]) == 2
    for grew in grown["learners"]:
        assert grew < size / 4, (grown, size)
    assert grown["shared"] < size / 2, (grown, size)         # two 2 MiB files in flight
    # The user's two models get new memory (2 models); the rest is in flight.
    assert grown["driver"] < 2.25 * size, (grown, size)
    start = make_trainer(ten_m_model).agents[0].state_dict()
    for trainer in (second, third):
        assert not torch.equal(trainer.agents[0].state_dict()["lm_head.weight"],
                               start["lm_head.weight"])


def test_a_local_run_that_will_not_fit_is_refused_before_any_actor_starts(tiny_model, tmp_path):
    """The seed config in a new process that starts its own Ray, on a machine that (as the
    check is told) has 1 GB available: train() raises MemoryError naming the estimate and
    the settings that help, before any actor starts (no "actors started" line)."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT, TEST_ENV

    script = (
        "import workers.driver.memory as memory\n"
        "memory.available_bytes = lambda: 10**9\n"
        "from tests.test_train_e2e import make_trainer\n"
        f"make_trainer({tiny_model!r}).train()\n")
    env = {**os.environ, **TEST_ENV, "WANDB_DIR": str(tmp_path), "WANDB_MODE": "offline"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode != 0
    assert "MemoryError: This run needs about" in proc.stdout, proc.stdout[-3000:]
    assert "1.0 GB available" in proc.stdout
    assert "engine_dtype='bfloat16'" in proc.stdout and "memory_check=False" in proc.stdout
    assert "actors started" not in proc.stdout
