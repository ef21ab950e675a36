"""The quiet console: actor output redirected to per-actor files, problems said once, the
header and summary, and weights that cross the object store without Ray's or NumPy's warnings."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from workers import console

ROOT = Path(__file__).resolve().parents[1]


def test_full_output_switches(monkeypatch):
    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    assert not console.full_output()
    assert not console.full_output(True)      # the default: progress bar only
    assert not console.full_output(False)
    assert console.full_output("full") and console.full_output(2)
    for value in ("1", "true", "full"):
        monkeypatch.setenv(console.VERBOSE_ENV, value)
        assert console.full_output(True)
    monkeypatch.setenv(console.VERBOSE_ENV, "0")
    assert not console.full_output(True)


def _run(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_redirect_catches_python_c_and_children_and_says_problems_once(tmp_path):
    log = tmp_path / "logs" / "rollout-agent0-worker0.log"
    proc = _run(f"""
        import os, subprocess, sys, warnings
        from workers.console import redirect_output, problem
        print("before")
        redirect_output({str(log)!r})
        print("python stdout")
        print("python stderr", file=sys.stderr)
        warnings.warn("a python warning")
        os.write(1, b"fd one\\n"); os.write(2, b"fd two\\n")
        subprocess.run(["echo", "a child process"])
        problem("an actor's weights did not load")
        problem("an actor's weights did not load")
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "before\n"
    assert proc.stderr.count("did not load") == 1, proc.stderr
    assert proc.stderr.startswith("comlrl-split: WARNING: an actor's weights did not load")
    text = log.read_text()
    for piece in ("output of this actor", "python stdout", "python stderr", "a python warning",
                  "fd one", "fd two", "a child process", "did not load"):
        assert piece in text, (piece, text)


def test_redirect_falls_back_when_the_folder_cannot_be_written(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = _run(f"""
        from workers.console import redirect_output
        print("USED", redirect_output({str(blocker / 'logs' / 'x.log')!r}), flush=True)
        import sys; sys.__stdout__.flush()
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""  # even the answer went into the fallback file
    import tempfile

    fallback = Path(tempfile.gettempdir()) / "comlrl-split-logs" / "x.log"
    assert f"USED {fallback}" in fallback.read_text()


def test_logging_to_redirects_before_the_class_init(tmp_path):
    log = tmp_path / "a.log"
    proc = _run(f"""
        from workers.ray_calls import logging_to

        class Actor:
            '''doc'''
            def __init__(self, x, y=0):
                print("init", x, y)
                self.x = x

        Logged = logging_to(Actor, {str(log)!r})
        a = Logged(1, y=2)
        assert Logged.__name__ == "Actor" and Logged.__doc__ == "doc" and a.x == 1
        assert a.log_file == {str(log)!r}
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and "init 1 2" in log.read_text()


def test_actor_logs_paths_and_placements(tmp_path, monkeypatch):
    from workers.driver.placement import Placement

    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    logs = console.ActorLogs.for_run(True, checkpoint_dir=str(tmp_path / "ckpt"))
    assert logs.folder == tmp_path / "logs"
    assert logs.path("rollout", 1, 0) == str(tmp_path / "logs" / "rollout-agent1-worker0.log")
    assert logs.path("checkpointer").endswith("logs/checkpointer.log")
    placed = logs.place(Placement(1.0), "learner", 0)
    assert placed.num_cpus == 1.0 and placed.log_file.endswith("learner-agent0.log")
    assert console.ActorLogs.for_run(True, str(tmp_path / "c"), str(tmp_path / "out")).folder \
        == tmp_path / "out" / "logs"
    monkeypatch.setenv(console.VERBOSE_ENV, "1")
    full = console.ActorLogs.for_run(True, checkpoint_dir=str(tmp_path / "ckpt"))
    assert full.folder is None and full.place(Placement(), "learner", 0).log_file is None


def test_header_and_summary(tmp_path, capsys):
    logs = console.ActorLogs(tmp_path / "logs")
    console.header(tmp_path, "tiny", {"rollout worker": 2, "learner": 2, "checkpointer": 1},
                   logs)
    ckpts = [str(tmp_path / "ck" / "checkpoint-1"), str(tmp_path / "ck" / "checkpoint-2")]
    info = {"id": "abc123", "folder": str(tmp_path / "wandb" / "offline-run-x-abc123"),
            "offline": True, "url": None}
    console.summary(ckpts, info, logs)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"comlrl-split: checkpoints go to: {tmp_path}"
    assert out[2] == (f"comlrl-split: actors started: 2 rollout workers, 2 learners, "
                      f"1 checkpointer (their output: {tmp_path / 'logs'})")
    assert f"checkpoints written: checkpoint-1, checkpoint-2 in {tmp_path / 'ck'}" in out[3]
    assert "W&B run: abc123" in out[4]
    # Every folder of the run id (one per process of a resumed offline run).
    assert out[5].endswith(f"wandb sync {tmp_path / 'wandb' / 'offline-run-*-abc123'}")
    assert out[6].endswith(f"actor logs: {tmp_path / 'logs'}")
    console.summary([], None, console.ActorLogs(None, full=True), checkpoint_dir="d")
    text = capsys.readouterr().out
    assert "checkpoints written: none (checkpoint_dir d)" in text and "W&B: off" in text


def test_wandb_offline_default(monkeypatch, capsys):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert not console.default_wandb_offline(None)
    assert not console.default_wandb_offline({"mode": "online"})
    assert console.default_wandb_offline({"project": "p"})
    assert os.environ["WANDB_MODE"] == "offline" and "logging offline" in capsys.readouterr().out
    assert not console.default_wandb_offline({"project": "p"})  # now WANDB_MODE is set


def test_packed_weights_round_trip_writable_without_warnings():
    import torch

    from workers.transports.buckets import pack_weights, unpack_weights

    state = {"w": torch.randn(3, 4), "b": torch.randn(4).to(torch.bfloat16),
             "t": torch.randn(4, 3).t(), "s": torch.tensor(2.5)}
    before = {k: v.clone() for k, v in state.items()}
    packed = pack_weights(state)
    for _, _, array in packed["weights"].values():
        array.setflags(write=False)  # as the object store hands them out
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = unpack_weights(packed)
    for name, tensor in state.items():
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape
        assert torch.equal(out[name], tensor)
        out[name].add_(1)  # writable, and not the sender's memory
    assert all(torch.equal(state[k], before[k]) for k in state)


def test_reload_check_drops_rotary_and_reports_other_layers():
    from workers.engines import _RELOAD_LOGGER, _ReloadCheck

    logger = logging.getLogger(_RELOAD_LOGGER)
    check = _ReloadCheck()
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep()
    logger.addFilter(check)
    logger.addHandler(handler)
    try:
        logger.warning("%s: Failed to load weights", "RotaryEmbedding")
        logger.warning("%s: Failed to load weights", "Llama3RotaryEmbedding")
        logger.warning("%s: Failed to load weights", "QKVParallelLinear")
        logger.warning("something else")
    finally:
        logger.removeFilter(check)
        logger.removeHandler(handler)
    assert check.layers == ["QKVParallelLinear"]
    assert seen == ["QKVParallelLinear: Failed to load weights", "something else"]


@pytest.mark.e2e
def test_actors_log_to_files_and_weights_push_cleanly(ray_session, tiny_model, tmp_path):
    """A vLLM rollout worker and a learner started with log files: their output lands there,
    and a packed push (object store) loads in full without a warning in either log."""
    import ray

    from tests.learner_probe import sequence_logprobs
    from workers.driver.placement import Placement
    from workers.ray_calls import kill_actors, start_actor
    from workers.roles.learner import Learner
    from workers.roles.rollout_worker import RolloutWorker
    from workers.transports.object_store import ObjectStoreTransport
    from workers.transports.endpoints import with_learner_endpoint

    logs = console.ActorLogs(tmp_path / "logs")
    sampling = dict(max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=None,
                    stop_token_ids=(0,))
    worker = start_actor(RolloutWorker, logs.place(Placement(0.5), "rollout", 0, 0), 0,
                         tiny_model, "vllm", sampling,
                         dict(kv_cache_memory_bytes=64 << 20, threads=1))
    learner = start_actor(with_learner_endpoint(Learner), Placement(0.5), 0, tiny_model,
                          log_file=logs.path("learner", 0), learning_rate=1e-2,
                          train_batch_size=2, threads=1)
    try:
        prompt = [30, 31, 32, 33]
        comps = [s["token_ids"] for s in ray.get(worker.generate.remote(
            [{"prompt_ids": prompt, "n": 2, "seed": 3}]))["outputs"][0]]
        groups = [{"prompt_ids": prompt, "completions": comps, "returns": [1.0, -1.0]}]
        assert ray.get(learner.update.remote(groups, 1))["version"] == 1
        for _ in range(2):
            ray.get(ObjectStoreTransport().push(0, learner, [worker], 1))
        assert ray.get(worker.get_version.remote()) == 1
        want = sequence_logprobs(learner, tiny_model, prompt, [comps[0]])[0]
        got = ray.get(worker.prompt_logprobs.remote(prompt + comps[0]))[len(prompt):]
        assert got == pytest.approx(want, abs=1e-4)
    finally:
        kill_actors([worker, learner])
    rollout_log = (tmp_path / "logs" / "rollout-agent0-worker0.log").read_text()
    learner_log = (tmp_path / "logs" / "learner-agent0.log").read_text()
    assert "output of this actor" in rollout_log and "output of this actor" in learner_log
    assert "vllm" in rollout_log.lower()  # vLLM's own start-up lines are in the file
    for text in (rollout_log, learner_log):
        for noise in ("ZeroCopyTensorsWarning", "not writable", "Failed to load weights",
                      "comlrl-split: WARNING"):
            assert noise not in text, (noise, text[-3000:])
