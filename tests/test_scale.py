"""Scale-out: placement (groups, pins, impossible requests), the single-GPU preset, weight
transports, results independent of the rollout-worker count, restarting a killed worker, and
a two-node run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest

from comlrl.config import MAGRPOConfig
from tests.conftest import ROOT, wandb_history
from workers.driver.placement import Placement, find_infeasible, plan_placement
from workers.transports.buckets import pack_bucket, plan_layout, unpack_bucket
from workers.transports.choice import resolve_transport

# Values that must not depend on how many workers drew the samples, or on a restart.
DETERMINISTIC = ("turn_1/reward_mean", "turn_1/expected_return", "agent_0/loss",
                 "agent_1/loss", "agent_0/completion_length", "agent_1/completion_length",
                 "agent_0/policy_version", "agent_1/policy_version")


# ---------------------------------------------------------------------- placement plans


@pytest.mark.parametrize("workers_per_agent", [1, 2, 3])
def test_single_gpu_preset_puts_every_actor_on_one_gpu(workers_per_agent):
    cfg = MAGRPOConfig(single_gpu=True, rollout_workers_per_agent=workers_per_agent,
                       gpu_memory_utilization=0.6)
    plan = plan_placement(cfg, num_agents=2)
    engines, learners = 2 * workers_per_agent, 2
    total = engines * plan["rollout"].num_gpus + learners * plan["learner"].num_gpus
    assert 0.99 <= total + 1e-3 and total <= 1.0
    assert 0 < plan["rollout"].num_gpus < 1 and plan["rollout"].num_gpus == plan["learner"].num_gpus
    # All engines together take gpu_memory_utilization of the GPU; the rest is the learners'.
    assert plan["gpu_memory_utilization"] * engines == pytest.approx(0.6)
    assert plan["strategy"] == "STRICT_PACK"
    assert plan["transport"] == "cuda_ipc"
    assert cfg.enable_sleep_mode
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        MAGRPOConfig(single_gpu=True, tensor_parallel_size=2)


def test_default_plan_packs_and_pins_custom_resources():
    cfg = MAGRPOConfig(rollout_resources={"rollout_node": 1}, learner_resources={"big": 0.5},
                       learner_num_gpus=1, rollout_num_cpus=1)
    plan = plan_placement(cfg, num_agents=2)
    assert plan["strategy"] == "PACK" and plan["transport"] == "object_store"
    assert plan["rollout"].bundle() == {"CPU": 1.0, "rollout_node": 1.0}
    assert plan["learner"].bundle() == {"CPU": 0.5, "GPU": 1.0, "big": 0.5}
    assert plan["gpu_memory_utilization"] == cfg.gpu_memory_utilization
    assert Placement().bundle() == {}


def test_object_store_fits_the_weights_within_a_quarter_of_memory():
    from workers.driver.cluster import object_store_bytes

    mib = 1024 * 1024
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert object_store_bytes(0) == 512 * mib                     # small models: the floor
    two_agents_76m = 2 * 306_319_360                              # 2 x 76.6M fp32 state dicts
    assert object_store_bytes(two_agents_76m) == 2 * two_agents_76m + 256 * mib
    assert object_store_bytes(10 * total) == total // 4           # never past a quarter


def test_weight_transport_resolution_and_validation():
    assert resolve_transport("auto", learner_gpus=0, rollout_gpus=0) == "object_store"
    assert resolve_transport("auto", learner_gpus=1, rollout_gpus=0) == "object_store"
    assert resolve_transport("auto", learner_gpus=1, rollout_gpus=1) == "nccl"
    assert resolve_transport("auto", learner_gpus=.3, rollout_gpus=.3, single_gpu=True) == \
        "cuda_ipc"
    assert resolve_transport("auto", learner_gpus=1, rollout_gpus=1,
                             tensor_parallel_size=2) == "object_store"
    assert resolve_transport("nccl", learner_gpus=0, rollout_gpus=0) == "nccl"  # gloo on CPU
    with pytest.raises(ValueError, match="cuda_ipc"):
        resolve_transport("cuda_ipc", learner_gpus=0, rollout_gpus=0)
    with pytest.raises(ValueError, match="single_gpu"):
        resolve_transport("nccl", learner_gpus=.3, rollout_gpus=.3, single_gpu=True)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        resolve_transport("nccl", learner_gpus=1, rollout_gpus=1, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="weight_transport"):
        MAGRPOConfig(weight_transport="tcp")
    with pytest.raises(ValueError, match="rollout_resources"):
        MAGRPOConfig(rollout_resources={"GPU": 1})
    with pytest.raises(ValueError, match="learner_resources"):
        MAGRPOConfig(learner_resources={"node": -1})
    with pytest.raises(ValueError, match="placement_timeout_s"):
        MAGRPOConfig(placement_timeout_s=0)


def test_infeasible_requests_name_the_setting():
    nodes = [{"CPU": 4, "GPU": 1, "memory": 1e9}, {"CPU": 8, "rollout_node": 4}]
    fits = [("rollout", Placement(1, 0, {"rollout_node": 1}))] * 4 + [("learner", Placement(1, 1))]
    assert find_infeasible(fits, nodes) is None
    # Cluster total is enough (12 CPUs) but no single node has 9.
    msg = find_infeasible([("rollout", Placement(9))], nodes)
    assert "rollout_num_cpus" in msg and "largest node has 8" in msg
    # Each resource exists somewhere, never together on one node.
    msg = find_infeasible([("learner", Placement(1, 1, {"rollout_node": 1}))], nodes)
    assert "combination" in msg and "learner_num_gpus" in msg
    msg = find_infeasible([("rollout", Placement(0.5, 0, {"gpu_node": 1}))], nodes)
    assert "rollout_resources['gpu_node']" in msg
    msg = find_infeasible([("learner", Placement(1, 1))] * 2, nodes)
    assert "learner_num_gpus" in msg and "need 2" in msg
    # single_gpu (STRICT_PACK): everything on one node.
    msg = find_infeasible([("rollout", Placement(3, 0.3))] * 2, nodes, "STRICT_PACK")
    assert "single_gpu" in msg


def test_colocate_puts_each_agents_learner_and_first_engine_in_one_bundle():
    """colocate=True: one host per agent reserving what its learner and its engine would,
    placed first, then the agents' other workers; evaluate() (no learners) stays split. A
    GPU weight transport cannot reach an engine in the learner's own process, so only 'auto'
    and 'object_store' are accepted, and the field is a plain bool."""
    from workers.driver.actors import actor_needs

    cfg = MAGRPOConfig(colocate=True, rollout_workers_per_agent=2, rollout_num_cpus=0.25,
                       learner_num_cpus=1, learner_num_gpus=0.5,
                       rollout_resources={"fast": 1}, learner_resources={"fast": 0.5})
    plan = plan_placement(cfg, num_agents=3)
    assert plan["host"].bundle() == {"CPU": 1.25, "GPU": 0.5, "fast": 1.5}
    assert plan["transport"] == "colocated"
    needs = actor_needs(cfg, plan, 3, for_eval=False)
    assert [role for role, _ in needs] == ["host"] * 3 + ["rollout"] * 3
    assert [role for role, _ in actor_needs(cfg, plan, 3, for_eval=True)] == ["rollout"] * 6
    split = MAGRPOConfig(rollout_workers_per_agent=2)
    assert [role for role, _ in actor_needs(split, plan_placement(split, 3), 3, False)] == \
        ["rollout"] * 6 + ["learner"] * 3
    msg = find_infeasible([("host", Placement(3))], [{"CPU": 2}])
    assert "rollout_num_cpus + learner_num_cpus" in msg
    assert MAGRPOConfig(colocate=True, weight_transport="object_store").colocate
    with pytest.raises(ValueError, match="weight_transport='auto'"):
        MAGRPOConfig(colocate=True, weight_transport="nccl")


def test_colocate_auto_means_a_local_cpu_run(monkeypatch):
    """colocate='auto' (the default) colocates on a local Ray the trainer starts with no GPU
    asked for; a cluster address, a job's driver, a Ray started by someone else, GPUs or a
    GPU transport keep the split layout; True and False are kept as given."""
    import ray

    from workers.driver import cluster as launch
    from workers.driver.placement import colocate_here

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    for name in ("RAY_ADDRESS", "RAY_JOB_CONFIG_JSON_ENV_VAR"):
        monkeypatch.delenv(name, raising=False)
    assert MAGRPOConfig().colocate == "auto" and colocate_here(MAGRPOConfig())
    for split in (dict(ray_address="10.0.0.1:6379"), dict(learner_num_gpus=1),
                  dict(rollout_num_gpus=0.5), dict(single_gpu=True),
                  dict(weight_transport="nccl")):
        assert not colocate_here(MAGRPOConfig(**split)), split
    assert colocate_here(MAGRPOConfig(colocate=True, learner_num_gpus=1))
    assert not colocate_here(MAGRPOConfig(colocate=False))
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    assert not colocate_here(MAGRPOConfig())
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setattr(ray, "is_initialized", lambda: True)   # a Ray this process started
    monkeypatch.setattr(launch, "_LOCAL_RAY", {"num_cpus": 2, "object_store": 1})
    assert colocate_here(MAGRPOConfig())
    monkeypatch.setattr(launch, "_LOCAL_RAY", {})              # ... or someone else did
    assert not colocate_here(MAGRPOConfig())
    assert "host" in plan_placement(MAGRPOConfig(), 2, colocate=True)
    assert "host" not in plan_placement(MAGRPOConfig(), 2)     # 'auto' needs colocate_here
    with pytest.raises(ValueError, match="colocate must be True, False or 'auto'"):
        MAGRPOConfig(colocate="yes")


# ---------------------------------------------------------------------- weight buckets


def test_bucket_layout_round_trip(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    state["extra.half"] = torch.randn(7, 3).half()
    params = [(k, list(v.shape), str(v.dtype).split(".")[-1]) for k, v in state.items()]
    layout = plan_layout(params, bucket_bytes=64 * 1024)
    assert 3 < len(layout["buckets"]) < len(params)
    assert sorted(i for b in layout["buckets"] for i in b["params"]) == list(range(len(params)))
    for b in layout["buckets"]:
        assert {layout["dtypes"][i] for i in b["params"]} == {b["dtype"]}
        assert b["bytes"] <= 64 * 1024 or len(b["params"]) == 1
    got = {}
    for b in layout["buckets"]:
        flat = pack_bucket([state[layout["names"][i]] for i in b["params"]], b, "cpu")
        got.update(unpack_bucket(flat.clone(), layout, b))
    assert got.keys() == state.keys()
    for k in state:
        assert got[k].dtype == state[k].dtype and torch.equal(got[k], state[k]), k


# ---------------------------------------------------------------------- on Ray


def _trainer(tiny_model, wandb_config=None, **overrides):
    from tests.test_train_e2e import make_trainer

    return make_trainer(tiny_model, wandb_config, verbose=False, **overrides)


@pytest.mark.e2e
def test_impossible_placement_fails_at_once(ray_session, tiny_model):
    start = time.time()
    # One CPU more than the node has (2 under ray_session; more if an earlier test's
    # trainer started this process's Ray itself).
    too_many = int(ray_session.cluster_resources()["CPU"]) + 1
    with pytest.raises(ValueError, match="rollout_num_cpus"):
        _trainer(tiny_model, rollout_num_cpus=too_many).train()
    with pytest.raises(ValueError, match=r"rollout_resources\['rollout_node'\]"):
        _trainer(tiny_model, rollout_resources={"rollout_node": 1}).train()
    assert time.time() - start < 60


@pytest.mark.e2e
def test_unreservable_placement_times_out_clearly(ray_session, tiny_model):
    from ray.util import placement_group, remove_placement_group

    held = placement_group([{"CPU": 1.5}])                        # another job holds 1.5 of 2
    assert held.wait(30)
    try:
        with pytest.raises(TimeoutError, match="placement_timeout_s"):
            _trainer(tiny_model, placement_timeout_s=3).train()
    finally:
        remove_placement_group(held)


@pytest.mark.e2e
def test_broadcast_transport_over_gloo_matches_the_learner(ray_session, tiny_model):
    """The bucketed broadcast (NCCL's code path, gloo backend on CPU) to a vLLM and an HF
    worker, and again after the HF one is replaced."""
    import ray

    from workers.ray_calls import kill_actors, start_actor
    from workers.roles.learner import Learner
    from workers.roles.rollout_worker import RolloutWorker
    from tests.learner_probe import sequence_logprobs
    from workers.transports.broadcast import NcclBroadcastTransport
    from workers.transports.endpoints import with_learner_endpoint

    sampling = dict(max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=None,
                    stop_token_ids=(0,))
    workers = [start_actor(RolloutWorker, Placement(0.25), 0, tiny_model, engine, sampling,
                           dict(kv_cache_memory_bytes=32 << 20, threads=1))
               for engine in ("vllm", "hf")]
    learner = start_actor(with_learner_endpoint(Learner), Placement(0.25), 0, tiny_model,
                          learning_rate=1e-2, train_batch_size=2, threads=1)
    try:
        transport = NcclBroadcastTransport(backend="gloo", bucket_bytes=128 * 1024)
        transport.connect(0, learner, workers)
        assert len(transport.layouts[0]["buckets"]) > 3       # several collective calls
        prompt = [30, 31, 32, 33, 34]
        comps = [[40, 41, 42, 43], [50, 51, 52], [60, 61]]
        before = ray.get(workers[0].prompt_logprobs.remote(prompt + comps[0]))
        res = ray.get(learner.update.remote(
            [{"prompt_ids": prompt, "completions": comps, "returns": [1.0, -0.5, -0.5]}], 1))
        ray.get(transport.push(0, learner, workers, res["version"]))
        want = sequence_logprobs(learner, tiny_model, prompt, [comps[0]])[0]
        for w in workers:
            assert ray.get(w.get_version.remote()) == res["version"]
            got = ray.get(w.prompt_logprobs.remote(prompt + comps[0]))[len(prompt):]
            assert got == pytest.approx(want, abs=1e-4)
        assert max(abs(a - b) for a, b in zip(got, before[len(prompt):])) > 1e-3
        # A replaced member: the group is rebuilt and everyone gets the weights again.
        kill_actors([workers[1]])
        workers[1] = start_actor(RolloutWorker, Placement(0.25), 0, tiny_model, "hf",
                                 sampling, dict(threads=1))
        ray.get(transport.refresh(0, learner, workers, 1, res["version"]))
        got = ray.get(workers[1].prompt_logprobs.remote(prompt + comps[0]))[len(prompt):]
        assert got == pytest.approx(want, abs=1e-4)
    finally:
        kill_actors(workers + [learner])


def _by_step(history):
    return {r["_step"]: {k: r[k] for k in DETERMINISTIC if k in r} for r in history
            if "turn_1/reward_mean" in r}


@pytest.fixture(scope="module")
def one_worker_run(ray_session, tiny_model, tmp_path_factory, monkeypatch_module):
    """The seed config, 2 epochs, one rollout worker per agent, split layout (the
    reference)."""
    d = tmp_path_factory.mktemp("one_worker")
    monkeypatch_module.setenv("WANDB_DIR", str(d))
    _trainer(tiny_model, {"project": "comlrl-tests", "name": "one-worker"},
             colocate=False).train()
    return _by_step(wandb_history(d))


def _wrap_each_session(monkeypatch, wrap):
    """Call `wrap(session)` on every workers.driver.session.Session once it has started, so a test
    can put fault injection around its verbs."""
    from workers.driver.session import Session

    enter = Session.__enter__

    def enter_and_wrap(session):
        enter(session)
        wrap(session)
        return session

    monkeypatch.setattr(Session, "__enter__", enter_and_wrap)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.e2e
@pytest.mark.slow
def test_two_workers_per_agent_and_killed_workers_log_the_same_values(
        one_worker_run, tiny_model, wandb_dir, monkeypatch):
    """Two rollout workers per agent log exactly what one worker logs, at every env_step,
    even though two of them are SIGKILLed mid-run: agent 1's worker 0 just before the first
    weight push, agent 0's worker 1 while it generates step 2. Both come back with the
    current weights and redo their part with its seeds.

    (One run checks both properties to keep this file short. If it fails, rerun it without
    the kills, e.g. `wrap` returning at once, to tell a worker-count difference from a
    restart difference.)"""
    import ray

    trainer = _trainer(tiny_model, {"project": "comlrl-tests", "name": "two-workers-kills"},
                       rollout_workers_per_agent=2, rollout_num_cpus=0.25, colocate=False)
    calls = {"generate": 0, "push": 0}
    killed = []

    def kill(pid):
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    def pid_of(worker):
        return ray.get(worker.node_info.remote())["pid"]

    def wrap(session):
        generate, push = session.generate, session.push_weights

        def generate_then_kill(requests, record):
            calls["generate"] += 1
            if calls["generate"] == 2:     # mid-generation: the call below is in flight
                threading.Timer(0.2, kill, (pid_of(session.workers[0][1]),)).start()
            return generate(requests, record)

        def kill_then_push():
            calls["push"] += 1
            if calls["push"] == 1:
                kill(pid_of(session.workers[1][0]))
            return push()

        session.generate, session.push_weights = generate_then_kill, kill_then_push

    _wrap_each_session(monkeypatch, wrap)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert len(killed) == 2
    restarts = [str(w.message) for w in caught if "restarted it" in str(w.message)]
    assert len(restarts) == 2, restarts
    assert "worker 0 of agent 1" in restarts[0] and "worker 1 of agent 0" in restarts[1]
    print("restarts:", *restarts, sep="\n  ")  # which path caught each death (-s shows it)
    history = wandb_history(wandb_dir)
    assert [r["rollout/restarts"] for r in history if "rollout/restarts" in r] == [1, 2]
    got = _by_step(history)
    assert sorted(got) == sorted(one_worker_run) == [8, 16, 24, 32]
    for step in one_worker_run:
        assert got[step] == one_worker_run[step], step      # exact, no tolerance


@pytest.mark.e2e
@pytest.mark.slow
def test_two_nodes_rollout_workers_pinned_to_the_worker_node(tiny_model, tmp_path):
    out = tmp_path / "nodes.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("WANDB_SERVICE", None)  # never join this pytest process's W&B service
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "two_node_script.py"),
                           "--model", tiny_model, "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=480, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    seen = json.loads(out.read_text())
    assert seen["env_step"] == 4
    assert seen["head"] != seen["worker_node"]
    assert seen["workers"] == [seen["worker_node"]] * 2
    assert seen["learners"] == [seen["head"]] * 2


@pytest.mark.e2e
@pytest.mark.slow
def test_dead_learner_and_checkpointer_are_healed_in_the_job(one_worker_run, tiny_model,
                                                            wandb_dir, tmp_path, monkeypatch):
    """A learner SIGKILLed during epoch 2's first update, then the checkpointer killed just
    before the epoch-2 checkpoint: each time the run restarts every learner and the
    checkpointer, restores them from checkpoint-1 and redoes epoch 2, in the same job. Every
    env_step is logged once, with exactly the values of the uninterrupted run."""
    import ray

    from comlrl.checkpoint import verify_checksums

    trainer = _trainer(tiny_model, {"project": "comlrl-tests", "name": "heal"},
                       colocate=False)
    calls = {"update": 0, "save": 0}
    killed = []

    def wrap(session):
        update, save = session.update_and_push, session.save_checkpoint

        def kill_learner_then_update(nodes, record):
            calls["update"] += 1
            if calls["update"] == 3:          # epoch 2's first update; checkpoint-1 exists
                os.kill(ray.get(session.learners[0].node_info.remote())["pid"], signal.SIGKILL)
                killed.append("learner 0")
            return update(nodes, record)

        def kill_checkpointer_then_save():
            calls["save"] += 1
            if calls["save"] == 2:            # the first attempt at checkpoint-2
                ray.kill(session.checkpointer, no_restart=True)
                killed.append("checkpointer")
            return save()

        session.update_and_push, session.save_checkpoint = (kill_learner_then_update,
                                                            kill_checkpointer_then_save)

    _wrap_each_session(monkeypatch, wrap)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(checkpoint_dir=str(tmp_path / "ckpt"))
    assert killed == ["learner 0", "checkpointer"]
    heals = [str(w.message) for w in caught if "restarted the learners" in str(w.message)]
    assert len(heals) == 2, heals
    assert heals[0].startswith("learner of agent 0 died") and "checkpoint-1" in heals[0]
    assert heals[1].startswith("checkpointer died") and "checkpoint-1" in heals[1]
    history = wandb_history(wandb_dir)
    steps = [r["_step"] for r in history if "turn_1/reward_mean" in r]
    assert steps == [8, 16, 24, 32]                   # each once, in order
    # The count rides on the next new row: the first heal's on step 24; the second heal redoes
    # only steps the run already holds, so no row carries its count (the warning above does).
    assert [r["actors/restarts"] for r in history if "actors/restarts" in r] == [1]
    got = _by_step(history)
    for step in one_worker_run:
        assert got[step] == one_worker_run[step], step      # exact, no tolerance
    for n in (1, 2):
        verify_checksums(tmp_path / "ckpt" / f"checkpoint-{n}")


@pytest.mark.e2e
@pytest.mark.slow
def test_colocated_hosts_with_a_second_worker_log_the_split_values_through_a_killed_host(
        one_worker_run, tiny_model, wandb_dir, tmp_path, monkeypatch):
    """colocate=True with two rollout workers per agent (worker 0 in the learner's host, fed
    by an in-process copy; worker 1 its own actor, fed through the object store) logs exactly
    what the split layout with one worker per agent logs, at every env_step, although agent
    1's host is SIGKILLed while epoch 2's first step generates. A host's death is its
    learner's: the run restarts every host and the checkpointer, restores them from the
    newest checkpoint and redoes the lost work (`Session.heal`), in the same job."""
    import ray

    trainer = _trainer(tiny_model, {"project": "comlrl-tests", "name": "colocated-heal"},
                       colocate=True, rollout_workers_per_agent=2, rollout_num_cpus=0.25,
                       learner_num_cpus=0.25)
    calls = {"generate": 0}
    killed, hosts = [], []

    def wrap(session):
        generate = session.generate
        assert session.pool.hosts and session.workers[1][0] == session.learners[1]
        hosts.append(session.learners[1])

        def generate_then_kill(requests, record):
            calls["generate"] += 1
            if calls["generate"] == 3:     # epoch 2's first step, while it generates
                pid = ray.get(session.learners[1].node_info.remote())["pid"]
                threading.Timer(0.2, os.kill, (pid, signal.SIGKILL)).start()
                killed.append(pid)
            return generate(requests, record)

        session.generate = generate_then_kill

    _wrap_each_session(monkeypatch, wrap)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(checkpoint_dir=str(tmp_path / "ckpt"))
    assert len(killed) == 1
    heals = [str(w.message) for w in caught if "restarted the learners" in str(w.message)]
    assert len(heals) == 1 and heals[0].startswith("learner of agent 1 died"), heals
    assert not [w for w in caught if "restarted it with the current weights" in str(w.message)]
    history = wandb_history(wandb_dir)
    assert [r["_step"] for r in history if "turn_1/reward_mean" in r] == [8, 16, 24, 32]
    got = _by_step(history)
    for step in one_worker_run:
        assert got[step] == one_worker_run[step], step      # exact, no tolerance
