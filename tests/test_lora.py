"""LoRA agents (`MAGRPOTrainer(peft_config=LoraConfig(...))`, comlrl/lora.py): adapters built
the same in every process, only the adapter trained, pushed, checkpointed and handed back,
real vLLM engines serving it, and resumes bit for bit.

comlrl 1.4.3 has no LoRA: `MAGRPOTrainer(..., peft_config=...)` raises TypeError
"MAGRPOTrainer.__init__() got an unexpected keyword argument 'peft_config'" (replayed in
benchmarks/.venv-comlrl, which has no peft installed either).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_resume import _assert_same_curves, _env, _run

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
COMPARED = ("turn_1/reward_mean", "turn_1/expected_return", "agent_0/loss", "agent_1/loss",
            "agent_2/loss", "agent_0/completion_length", "agent_1/completion_length",
            "agent_2/completion_length", "agent_0/policy_version", "train/epoch")


def _lora_cmd(model, ckpt, epochs, resume=None, *extra):
    cmd = [sys.executable, str(ROOT / "tests" / "lora_script.py"), "--model", model,
           "--checkpoint-dir", str(ckpt), "--epochs", str(epochs)]
    return cmd + (["--resume", str(resume)] if resume else []) + list(extra)


def _adapters(checkpoint: Path) -> list[dict]:
    from safetensors.torch import load_file

    return [load_file(str(checkpoint / f"agent_{a}" / "adapter_model.safetensors"))
            for a in range(3)]


def _same_adapters(a: Path, b: Path) -> None:
    for x, y in zip(_adapters(a), _adapters(b)):
        assert x.keys() == y.keys()
        for k in x:
            assert (x[k] == y[k]).all(), k


@pytest.fixture(scope="module")
def lora_straight(tiny_model, tmp_path_factory):
    """3 LoRA agents, the seed example's settings otherwise, 4 epochs in one process, then
    `save_model` (adapter folders) and `save_model(merge=True)`."""
    d = tmp_path_factory.mktemp("lora-straight")
    proc = _run(_lora_cmd(tiny_model, d / "ckpt", 4, None, "--save-model", str(d / "saved")),
                _env(d / "wandb"))
    return d, proc


@pytest.mark.e2e
def test_agents_on_one_base_share_one_engine(lora_straight):
    """The three LoRA agents of one base run in three hosts (one learner each) and ONE vLLM
    engine serving the three adapters: the run says so, and only one actor's log holds a
    vLLM engine's start."""
    d, proc = lora_straight
    assert "actors started: 1 learner+engine host, 2 learner hosts" in proc.stdout + proc.stderr
    logs = sorted((d / "logs").glob("host-agent*.log"))
    assert len(logs) == 3
    assert [("Enforce eager set" in p.read_text()) for p in logs] == [True, False, False]


# ---------------------------------------------------------------- pure parts (no Ray, no vLLM)


def test_adapters_are_the_same_in_every_process_and_differ_per_agent(tiny_model, tmp_path):
    """make_lora_agents seeds each agent's adapter init by (seed, agent), and the adapter
    config is written in one byte order (peft keeps target_modules as a set, which it writes
    in the process's hash order): two processes with different hash seeds write byte-equal
    folders, whose base is the model's own weights under its own names."""
    script = (
        "import sys; from transformers import AutoModelForCausalLM; from peft import LoraConfig;"
        "from comlrl import lora;"
        f"ms = [AutoModelForCausalLM.from_pretrained({tiny_model!r}) for _ in range(2)];"
        f"ps = lora.make_lora_agents(ms, LoraConfig(r=8, target_modules={TARGETS!r}), 42);"
        "[lora.save_lora_folder(p, sys.argv[1] + f'/agent_{i}') for i, p in enumerate(ps)]")
    for seed in ("1", "2"):
        subprocess.run([sys.executable, "-c", script, str(tmp_path / seed)], check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)},
                       capture_output=True)
    for rel in ("model.safetensors", "adapter/adapter_config.json",
                "adapter/adapter_model.safetensors"):
        one, two = (tmp_path / s / "agent_0" / rel for s in ("1", "2"))
        assert one.read_bytes() == two.read_bytes(), rel
    from safetensors.torch import load_file

    a0, a1 = (load_file(str(tmp_path / "1" / f"agent_{i}" / "adapter" /
                            "adapter_model.safetensors")) for i in range(2))
    lora_a = [k for k in a0 if "lora_A" in k]
    assert lora_a and any(not (a0[k] == a1[k]).all() for k in lora_a)   # per-agent init
    assert all((a0[k] == 0).all() for k in a0 if "lora_B" in k)        # starts as the base
    base, own = load_file(str(tmp_path / "1" / "agent_0" / "model.safetensors")), \
        load_file(str(Path(tiny_model) / "model.safetensors"))
    assert base.keys() == own.keys() and all((base[k] == own[k]).all() for k in own)


def test_learners_of_one_linked_base_take_turns_in_their_updates(tiny_model, tmp_path):
    """Two CPU learners with `take_turns` whose folders hard-link one base file (as
    `save_models` links a group's base) update one at a time: while the first is inside its
    update, the second does not begin (it waits for the first's turn to end). Learners of
    two separate copies of the base do not wait for each other."""
    import threading

    from transformers import AutoModelForCausalLM
    from peft import LoraConfig

    from comlrl import lora
    from workers.roles.learner import Learner

    ms = [AutoModelForCausalLM.from_pretrained(tiny_model) for _ in range(3)]
    ps = lora.make_lora_agents(ms, LoraConfig(r=8, target_modules=TARGETS), 42)
    lora.save_lora_folder(ps[0], tmp_path / "a0")
    lora.save_lora_folder(ps[1], tmp_path / "a1", base_from=tmp_path / "a0")   # linked
    lora.save_lora_folder(ps[2], tmp_path / "b")                               # a copy
    groups = [{"prompt_ids": [3, 4, 5], "completions": [[6, 7], [8, 9, 10]],
               "returns": [1.0, 0.0], "turn": 0}]

    def overlapped(first: str, second: str) -> bool:
        a, b = (Learner(i, str(tmp_path / f), learning_rate=1e-3, train_batch_size=1,
                        device="cpu", threads=1, take_turns=True)
                for i, f in enumerate((first, second)))
        a_in, b_in, seen = threading.Event(), threading.Event(), []
        inner_a, inner_b = a._update, b._update

        def a_update(*args):
            a_in.set()
            seen.append(b_in.wait(timeout=3.0))     # does b get in while a is inside?
            return inner_a(*args)

        def b_update(*args):
            b_in.set()
            return inner_b(*args)

        a._update, b._update = a_update, b_update
        first_thread = threading.Thread(target=a.update, args=(groups, 0))
        first_thread.start()
        assert a_in.wait(timeout=30)
        second_thread = threading.Thread(target=b.update, args=(groups, 0))
        second_thread.start()
        first_thread.join()
        second_thread.join()
        assert b_in.is_set()                      # b did update, once a was done
        return seen[0]

    assert overlapped("a0", "a1") is False
    assert overlapped("a0", "b") is True


def test_peft_config_other_than_lora_is_refused_naming_the_field():
    from peft import LoraConfig, PromptTuningConfig

    from comlrl.lora import check_peft_config

    with pytest.raises(ValueError, match="peft_config must be a peft.LoraConfig"):
        check_peft_config(PromptTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM"))
    with pytest.raises(ValueError, match="peft_config.modules_to_save"):
        check_peft_config(LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    check_peft_config(LoraConfig(r=4, target_modules=["q_proj"]))


# ---------------------------------------------------------------- real engines and runs


@pytest.mark.e2e
def test_a_vllm_engine_serves_the_pushed_adapter(ray_session, tiny_model, tmp_path):
    """A LoRA agent's vLLM engine (a rollout worker actor; enable_lora, the adapter loaded by
    path from tmpfs): with the fresh adapter (lora_B = 0) it scores a sequence as the base
    model's engine does (to float rounding: vLLM's LoRA layers take another GEMM path, so
    samples may differ in a few tokens); after a push of an adapter with random lora_B its
    samples change, and equal those of a new engine started on that adapter; a push of the
    zero adapter brings back exactly the samples it drew first."""
    import ray
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from comlrl import lora
    from workers.driver.placement import Placement
    from workers.ray_calls import kill_actors, start_actor
    from workers.roles.rollout_worker import RolloutWorker

    model = lora.make_lora_agents([AutoModelForCausalLM.from_pretrained(tiny_model)],
                                  LoraConfig(r=8, target_modules=TARGETS), 42)[0]
    lora.save_lora_folder(model, tmp_path / "fresh")
    zero = {k: v.clone() for k, v in lora.adapter_state_dict(model).items()}
    gen = torch.Generator().manual_seed(0)
    changed = {k: (torch.randn(v.shape, generator=gen) * 0.5 if "lora_B" in k else v)
               for k, v in zero.items()}
    lora.load_adapter_state(model, changed, "test")
    lora.save_lora_folder(model, tmp_path / "changed")

    sampling = dict(max_new_tokens=24, temperature=1.0, top_p=1.0, top_k=None)
    requests = [{"prompt_ids": [5, 6, 7, 8, 9], "n": 4, "seed": 11},
                {"prompt_ids": [20, 21, 22], "n": 4, "seed": 12}]

    def worker(folder, slots=1):
        return start_actor(RolloutWorker, Placement(0.5), 0, str(folder), "vllm", sampling,
                           dict(kv_cache_memory_bytes=64 << 20, threads=1, seed=42,
                                lora_slots=slots))

    def sample(actor, agent=None):
        out = ray.get(actor.generate.remote(requests, agent))["outputs"]
        return [[s["token_ids"] for s in samples] for samples in out]

    actors = []
    try:
        scored = [5, 6, 7, 8, 9, 40, 41, 42, 43, 44, 45]
        actors.append(worker(tiny_model))
        want_scores = ray.get(actors[-1].prompt_logprobs.remote(scored))
        actors.append(worker(tmp_path / "fresh"))
        engine = actors[-1]
        assert ray.get(engine.__ray_call__.remote(
            lambda self: self.engine.llm.llm_engine.vllm_config.lora_config.max_lora_rank)) == 8
        assert ray.get(engine.prompt_logprobs.remote(scored)) == pytest.approx(want_scores,
                                                                               abs=1e-4)
        first = sample(engine)
        assert sample(engine) == first
        ray.get(engine.update_weights.remote(1, changed))
        got_changed = sample(engine)
        assert got_changed != first
        assert ray.get(engine.prompt_logprobs.remote(scored)) != pytest.approx(want_scores,
                                                                               abs=1e-2)
        ray.get(engine.update_weights.remote(2, zero))
        assert sample(engine) == first
        actors.append(worker(tmp_path / "changed"))
        assert sample(actors[-1]) == got_changed

        # One engine serving three agents' adapters: a push to agent 1 changes agent 1's
        # samples alone, and each agent's outputs carry its own weight version.
        kill_actors(actors)
        actors = [worker(tmp_path / "fresh", slots=3)]
        shared = actors[0]
        for agent in (1, 2):
            ray.get(shared.update_weights.remote(0, zero, agent))
        assert [sample(shared, a) for a in range(3)] == [first] * 3
        ray.get(shared.update_weights.remote(5, changed, 1))
        assert [sample(shared, a) for a in range(3)] == [first, got_changed, first]
        assert [ray.get(shared.generate.remote(requests, a))["version"]
                for a in range(3)] == [0, 5, 0]
    finally:
        kill_actors(actors)


@pytest.mark.e2e
def test_lora_agents_resume_bit_for_bit_and_save_adapters(lora_straight, tiny_model, tmp_path):
    """3 LoRA agents: 2 epochs, then a new process resumes from checkpoint-2 to 4 into the
    same W&B run; every logged value and every adapter weight equal the straight 4-epoch run.
    The checkpoints hold the adapters and their AdamW state, not the base (each agent's
    folder is a small part of the base's bytes), and `save_model` writes PEFT adapter folders
    (`PeftModel.from_pretrained(base, folder)`) and, with merge=True, `from_pretrained`
    folders computing what the adapter on its base computes."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    straight, _ = lora_straight
    ckpt, env = tmp_path / "ckpt", _env(tmp_path / "wandb")
    _run(_lora_cmd(tiny_model, ckpt, 2), env)
    _run(_lora_cmd(tiny_model, ckpt, 4, ckpt / "checkpoint-2"), env)
    got = _assert_same_curves(ckpt, tmp_path / "wandb", straight / "wandb", COMPARED)
    assert sorted(got) == list(range(8, 65, 8))
    _same_adapters(straight / "ckpt" / "checkpoint-4", ckpt / "checkpoint-4")
    # The adapters trained: lora_B left zero.
    assert any((v != 0).any() for v in _adapters(ckpt / "checkpoint-4")[0].values())

    base_bytes = (Path(tiny_model) / "model.safetensors").stat().st_size
    for a in range(3):
        folder = ckpt / "checkpoint-4" / f"agent_{a}"
        names = {p.name for p in folder.iterdir()}
        assert "model.safetensors" not in names and "adapter_config.json" in names
        weights = sum(p.stat().st_size for p in folder.iterdir()
                      if p.name in ("adapter_model.safetensors", "optimizer.pt"))
        assert weights < 0.6 * base_bytes, (weights, base_bytes)

    saved = straight / "saved"
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    for a in range(3):
        adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model),
                                            str(saved / f"agent_{a}"))
        trained = _adapters(straight / "ckpt" / "checkpoint-4")[a]
        from comlrl.lora import adapter_state_dict

        mine = adapter_state_dict(adapter)
        assert mine.keys() == trained.keys()
        assert all((mine[k] == trained[k]).all() for k in mine)
        merged = AutoModelForCausalLM.from_pretrained(str(straight / "saved-merged" /
                                                          f"agent_{a}"))
        with torch.no_grad():
            assert torch.allclose(merged(ids).logits, adapter(ids).logits, atol=1e-5)
    assert json.loads((saved / "agent_0" / "adapter_config.json").read_text())["r"] == 8


@pytest.mark.e2e
@pytest.mark.slow
def test_kill_9_just_after_a_checkpoint_then_resume_matches(lora_straight, tiny_model,
                                                            tmp_path):
    """kill -9 of the whole LoRA run the moment checkpoint-1 appears, then a resume from the
    newest checkpoint in a new process: the same values and adapters as the straight run."""
    straight, _ = lora_straight
    ckpt, env = tmp_path / "ckpt", _env(tmp_path / "wandb")
    proc = subprocess.Popen(_lora_cmd(tiny_model, ckpt, 4), env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while not (ckpt / "checkpoint-1").is_dir() and time.time() < deadline \
                and proc.poll() is None:
            time.sleep(0.01)
        assert (ckpt / "checkpoint-1").is_dir(), "no checkpoint appeared"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        time.sleep(2)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    from comlrl.checkpoint import list_checkpoints

    newest = list_checkpoints(str(ckpt))[-1]
    _run(_lora_cmd(tiny_model, ckpt, 4, newest), env)
    _assert_same_curves(ckpt, tmp_path / "wandb", straight / "wandb", COMPARED)
    _same_adapters(straight / "ckpt" / "checkpoint-4", ckpt / "checkpoint-4")


@pytest.mark.e2e
@pytest.mark.parametrize("change,needle", [
    ("r=16", "peft_config.r: checkpoint has [8, 8, 8], this run has [16, 16, 16]"),
    ("lora_alpha=32", "peft_config.lora_alpha: checkpoint has [16, 16, 16]"),
    ("target_modules=['q_proj', 'v_proj']", "peft_config.target_modules: checkpoint has"),
    ("base", "models: checkpoint has"),
])
def test_a_resume_with_other_adapter_settings_is_refused_naming_the_field(
        lora_straight, tiny_model, tmp_path, change, needle):
    """A resume whose adapters differ in rank, alpha or target modules, or whose base is
    another model (a tiny model of another seed), is refused before anything starts."""
    straight, _ = lora_straight
    model, extra = tiny_model, ["--lora", change]
    if change == "base":
        from comlrl.tiny_model import build_tiny_model

        model, extra = str(build_tiny_model(tmp_path / "other", seed=1)), []
    proc = subprocess.run(
        _lora_cmd(model, tmp_path / "ckpt", 4, straight / "ckpt" / "checkpoint-2", *extra),
        env=_env(tmp_path / "wandb"), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "cannot resume" in proc.stderr and needle in proc.stderr, proc.stderr[-3000:]
