"""Actors: which parked actors a later train() may take (workers/driver/actors.py `warm_key`,
pure), how a local Ray gives them their environment, and an agent host
(workers/roles/agent_host.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from comlrl.config import MAGRPOConfig
from comlrl.inputs import build_formatters
from comlrl.tiny_model import build_tiny_model
from tests.test_rollout_tree import FakeTokenizer
from workers.driver.actors import Actors, actor_settings, model_shape, use_folders, warm_key
from workers.driver.placement import plan_placement
from workers.model_source import pack_model_folder

ROOT = Path(__file__).resolve().parents[1]


def _key(args: MAGRPOConfig, folders: list[str], logs: str = "/runs/logs",
         rows: tuple = ({"prompt": "a question"},)) -> str:
    trainer = SimpleNamespace(args=args, num_agents=2, tokenizers=[FakeTokenizer()] * 2,
                              formatters=build_formatters(None, 2),
                              train_rows=list(rows), eval_rows=None)
    plan = plan_placement(args, 2)
    workers = 2 * args.rollout_workers_per_agent
    needs = [("rollout", plan["rollout"])] * workers + [("learner", plan["learner"])] * 2
    return warm_key(actor_settings(trainer, plan, 2, workers), needs, plan, folders, logs, None)


def test_only_the_weights_may_differ(tmp_path: Path):
    """Models that differ only in their weights (two seeds) give the same key: the weights
    are pushed. Another architecture, another setting that builds the actors, or another log
    folder gives another key, so those actors are dropped and new ones started."""
    a = build_tiny_model(tmp_path / "a", seed=0)
    b = build_tiny_model(tmp_path / "b", seed=1)
    for folder in (a, b):   # the builder's own record of its seed; sessions save without it
        (folder / "tiny_model.json").unlink()
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()
    assert model_shape(str(a)) == model_shape(str(b))
    base = _key(MAGRPOConfig(), [str(a)] * 2)
    assert _key(MAGRPOConfig(), [str(b)] * 2) == base
    # What a resume may change without touching the actors keeps the key.
    assert _key(MAGRPOConfig(num_train_epochs=9, logging_steps=3), [str(a)] * 2) == base

    config = json.loads((b / "config.json").read_text())
    config["rope_theta"] = float(config.get("rope_theta", 10000.0)) * 2
    (b / "config.json").write_text(json.dumps(config))
    assert _key(MAGRPOConfig(), [str(a), str(b)]) != base
    assert _key(MAGRPOConfig(agent_learning_rate=1e-3), [str(a)] * 2) != base
    assert _key(MAGRPOConfig(max_new_tokens=7), [str(a)] * 2) != base
    assert _key(MAGRPOConfig(rollout_workers_per_agent=2), [str(a)] * 2) != base
    assert _key(MAGRPOConfig(), [str(a)] * 2, logs="/elsewhere/logs") != base
    # Engines hold the run's longest prompt + max_new_tokens (their KV cache's size):
    # prompts within the same 128-token blocks keep them, a longer one starts new ones. A
    # multi-turn run (the default, 2 turns) sizes them for the model's longest length.
    one_turn = _key(MAGRPOConfig(num_turns=1), [str(a)] * 2)
    assert one_turn != base
    assert _key(MAGRPOConfig(num_turns=1), [str(a)] * 2,
                rows=({"prompt": "another, longer question"},)) == one_turn
    assert _key(MAGRPOConfig(num_turns=1), [str(a)] * 2,
                rows=({"prompt": "a" * 300},)) != one_turn


def test_final_weights_go_into_fresh_memory_of_the_same_parameters(tmp_path: Path):
    """`into_fresh_memory` (how `pull_weights` hands the final weights to the user's models):
    every Parameter object stays the one the user holds, now in memory of its own (not the
    safetensors file `from_pretrained` mapped) holding the given values; tied weights stay
    one tensor; a state dict with a missing or reshaped weight is refused, naming it.
    comlrl 1.4.3 trains the user's Parameters in place: after a 1-epoch train() of the
    0.43M model the same objects held new values, and so did a `.data` taken before. Here
    the objects are kept and their memory is new (README, Differences)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from workers.roles.learner import into_fresh_memory

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    torch.manual_seed(1)
    other = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    other["lm_head.weight"] = other["model.embed_tokens.weight"]
    params = dict(model.named_parameters())
    pointers = {k: p.data_ptr() for k, p in params.items()}

    into_fresh_memory(model, other)
    assert dict(model.named_parameters()) == params        # the same objects
    for name, value in model.state_dict().items():
        assert torch.equal(value, other[name]), name
        assert value.data_ptr() != other[name].data_ptr(), name   # a copy, not a view
    assert all(params[k].data_ptr() != pointers[k] for k in params)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    other["model.norm.weight"].add_(1.0)                   # the source changing later ...
    assert not torch.equal(model.model.norm.weight, other["model.norm.weight"])   # ... doesn't

    missing = {k: v for k, v in other.items() if k != "model.norm.weight"}
    with pytest.raises(RuntimeError, match="model.norm.weight"):
        into_fresh_memory(model, missing)
    reshaped = dict(other, **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(RuntimeError, match="model.norm.weight"):
        into_fresh_memory(model, reshaped)


def _mapped_from(name: str) -> list[tuple[int, int]]:
    """Address ranges of this process mapped from files called `name` (/proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith("/" + name):
            start, end = line.split()[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def test_a_cpu_learner_trains_weights_in_memory_of_its_own(tiny_model):
    """`from_pretrained` leaves every weight inside the mapped safetensors file (checked here
    first), so a learner's first AdamW step would fault them in copy-on-write, 4 KB at a time;
    a CPU learner copies them into memory of its own at start, with the file's values."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from workers.roles.learner import Learner

    def inside_file(model) -> list[str]:
        ranges = _mapped_from("model.safetensors")
        return [n for n, p in model.named_parameters()
                if any(start <= p.data_ptr() < end for start, end in ranges)]

    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    names = [n for n, _ in plain.named_parameters()]
    assert inside_file(plain) == names
    del plain
    learner = Learner(0, tiny_model, learning_rate=1e-3, train_batch_size=2, device="cpu")
    assert inside_file(learner.model) == []
    saved = load_file(str(Path(tiny_model) / "model.safetensors"))
    state = learner.model.state_dict()
    for name, value in saved.items():
        assert torch.equal(state[name], value), name


def test_warm_actors_restart_from_the_taking_runs_model_folders():
    """Warm actors live on a local Ray, where actors load the driver's model folders by path
    (`model_sources`); the run that parked them deleted its folders, so taking them points
    every restart spec (rollout workers' and learners') at the taking run's folders and
    keeps everything else in the specs."""
    pool = SimpleNamespace(specs={(a, i): ("Worker", f"placement{a}{i}", a, f"/old/agent_{a}",
                                           "vllm", {"n": a}, {"threads": 1})
                                  for a in range(2) for i in range(2)})
    actors = Actors("key", pool, learner_specs=[(("Learner", f"p{a}", a, f"/old/agent_{a}"),
                                                 {"lr": a}) for a in range(2)])
    use_folders(actors, ["/new/agent_0", "/new/agent_1"])
    assert pool.specs == {(a, i): ("Worker", f"placement{a}{i}", a, f"/new/agent_{a}", "vllm",
                                   {"n": a}, {"threads": 1}) for a in range(2) for i in range(2)}
    assert actors.learner_specs == [(("Learner", f"p{a}", a, f"/new/agent_{a}"), {"lr": a})
                                    for a in range(2)]


def test_a_packed_model_is_written_out_for_loading_and_removed_even_when_loading_fails(
        tmp_path: Path, monkeypatch, tiny_model):
    """Actors on a Ray the trainer did not start get each model packed through the object
    store (`model_sources`) and write it out to load it. The copy is gone once a learner has
    loaded it, and also when the engine fails to start (an actor restarted in a loop would
    otherwise fill /tmp with copies); a folder path is used in place and left alone."""
    import tempfile

    from workers.roles.learner import Learner
    from workers.roles.rollout_worker import RolloutWorker

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    packed = pack_model_folder(tiny_model)
    learner = Learner(0, packed, learning_rate=1e-3, train_batch_size=2)
    assert sum(p.numel() for p in learner.model.parameters()) > 0
    assert learner.tokenizer_files["tokenizer.json"] == \
        (Path(tiny_model) / "tokenizer.json").read_bytes()
    assert list(scratch.iterdir()) == []
    with pytest.raises(ValueError, match="rollout_engine must be 'vllm' or 'hf'"):
        RolloutWorker(0, packed, "nope", dict(max_new_tokens=8, temperature=1.0, top_p=1.0,
                                              top_k=None), {})
    assert list(scratch.iterdir()) == []
    before = sorted(p.name for p in Path(tiny_model).iterdir())
    Learner(0, tiny_model, learning_rate=1e-3, train_batch_size=2)
    assert sorted(p.name for p in Path(tiny_model).iterdir()) == before


def test_a_checkpoint_write_holds_the_state_of_its_save_though_an_update_follows_at_once(
        tmp_path: Path, tiny_model):
    """On the CPU a learner's checkpoint write reads the live weights and AdamW state (no
    copy on the driver's path): the next update must wait for it. The write is held 1 s
    here, and an update sent meanwhile still leaves the files with the state of the save.
    Weights, optimizer and RNG files are hashed while written: their digests are the files'."""
    import time

    import torch
    from safetensors.torch import load_file

    from comlrl.checkpoint import file_digest
    from workers.roles.learner import OPTIMIZER_FILE, RNG_FILE, Learner

    learner = Learner(0, tiny_model, learning_rate=1e-2, train_batch_size=2)
    learner.update(_groups(), shuffle_seed=0)          # AdamW state exists from here on
    at_save = {k: v.clone() for k, v in learner.model.state_dict().items()}
    moments = {i: s["exp_avg"].clone() for i, s in learner.optimizer.state_dict()["state"].items()}
    original = learner.model.save_pretrained

    def held(*args, **kwargs):
        time.sleep(1.0)
        return original(*args, **kwargs)

    learner.model.save_pretrained = held
    learner.save(str(tmp_path / "agent_0"))
    learner.update(_groups(), shuffle_seed=1)          # sent while the write is held
    files = learner.saved()
    # The files hashed while written report their digests (the commit records them unread).
    folder = tmp_path / "agent_0"
    assert sorted(files) == sorted(p.name for p in folder.iterdir())
    hashed = {OPTIMIZER_FILE, RNG_FILE, "model.safetensors"}
    assert {name for name, digest in files.items() if digest} == hashed
    for name in hashed:
        assert files[name] == file_digest(folder / name), name
    written = load_file(str(tmp_path / "agent_0" / "model.safetensors"))
    for name, value in written.items():
        assert torch.equal(value, at_save[name]), name
    assert any(not torch.equal(v, at_save[k]) for k, v in learner.model.state_dict().items())
    optimizer = torch.load(tmp_path / "agent_0" / OPTIMIZER_FILE, weights_only=False)
    for i, state in optimizer["state"].items():
        assert torch.equal(state["exp_avg"], moments[i])


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges of this process that map the file at `path` (/proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def _groups() -> list[dict]:
    return [{"prompt_ids": [5, 6, 7], "completions": [[8, 9, 3], [10, 11]],
             "returns": [1.0, 0.0], "turn": 0}]


def _saved_learner(tiny_model, folder: Path):
    """A learner after one update, its state saved into `folder` (as a checkpoint's agent)."""
    from workers.roles.learner import Learner

    learner = Learner(0, tiny_model, learning_rate=1e-2, train_batch_size=2)
    learner.update(_groups(), shuffle_seed=0)
    learner.save(str(folder))
    learner.saved()
    return learner


def test_a_learner_restores_adamw_state_into_its_own_memory_never_the_files_mapping(
        tmp_path: Path, tiny_model):
    """Learner.load maps optimizer.pt and copies each AdamW tensor into the optimizer's own
    tensor of that name and shape (a warm learner's: the same memory as before the load),
    or into fresh memory (a new learner has no state yet). Either way the restored state
    equals the saved one bit for bit and no tensor points into the file's mapping, which
    AdamW's in-place writes would fault and copy page by page."""
    import torch

    from workers.roles.learner import OPTIMIZER_FILE, Learner

    folder = tmp_path / "agent_0"
    warm = _saved_learner(tiny_model, folder)
    saved = torch.load(folder / OPTIMIZER_FILE, weights_only=False)
    warm.update(_groups(), shuffle_seed=1)              # the state moves on from the save
    before = {(i, k): v.data_ptr() for i, s in warm.optimizer.state_dict()["state"].items()
              for k, v in s.items()}
    fresh = Learner(0, tiny_model, learning_rate=1e-2, train_batch_size=2)
    assert not fresh.optimizer.state_dict()["state"]
    for learner in (warm, fresh):
        learner.load(str(folder))
        state = learner.optimizer.state_dict()["state"]
        mapped = _mapped_ranges((folder / OPTIMIZER_FILE).resolve())
        assert state.keys() == saved["state"].keys()
        for i, entry in state.items():
            for k, v in entry.items():
                assert torch.equal(v, saved["state"][i][k]), (i, k)
                assert not any(a <= v.data_ptr() < b for a, b in mapped), (i, k)
                if learner is warm:
                    assert v.data_ptr() == before[(i, k)], (i, k)
    # Both restored learners take the same next step.
    warm.update(_groups(), shuffle_seed=2)
    fresh.update(_groups(), shuffle_seed=2)
    for (name, a), b in zip(warm.model.state_dict().items(), fresh.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_learner_resumes_without_reading_a_checkpoint_its_state_still_is(
        tmp_path: Path, tiny_model):
    """Learner.resume(folder, files) restores RNG and version only while the learner's state
    is still exactly what it saved there (or loaded from there; `holds`, which the driver
    also asks to choose how to verify the checkpoint): its weight and AdamW files
    are not read (here they are overwritten with other bytes after the save, and the kept
    state stays what it was). After an update, or in a new learner, or for a folder whose
    recorded digests are not the learner's, it loads as `load` does, and then holds that
    folder. The seed example's resume continues from the checkpoint its first train() wrote
    (tests/test_resume.py compares that run with a straight one, bit for bit)."""
    import shutil

    import torch

    from comlrl.checkpoint import file_digest
    from workers.roles.learner import OPTIMIZER_FILE, Learner

    folder = tmp_path / "agent_0"
    learner = _saved_learner(tiny_model, folder)
    files = {f"agent_0/{f.name}": file_digest(f) for f in folder.iterdir()}
    weights = {k: v.clone() for k, v in learner.model.state_dict().items()}
    adam = {(i, k): v.clone() for i, s in learner.optimizer.state_dict()["state"].items()
            for k, v in s.items()}
    rng = torch.random.get_rng_state()
    torch.rand(3)                                  # the RNG moves on; resume puts it back
    good = tmp_path / "good"
    shutil.copytree(folder, good)
    for name in ("model.safetensors", OPTIMIZER_FILE):      # a read would now fail
        (folder / name).write_bytes(b"\0" * 64)
    assert learner.holds("agent_0", files) and not learner.holds("agent_1", files)
    assert learner.resume(str(folder), files) == (1, True)
    assert torch.equal(torch.random.get_rng_state(), rng)
    for k, v in learner.model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    shutil.rmtree(folder)
    shutil.copytree(good, folder)

    def holds_saved_state(who: Learner) -> None:
        for k, v in who.model.state_dict().items():
            assert torch.equal(v, weights[k]), k
        for i, s in who.optimizer.state_dict()["state"].items():
            for k, v in s.items():
                assert torch.equal(v, adam[(i, k)]), (i, k)

    learner.update(_groups(), shuffle_seed=1)         # the state moves on from the save
    assert not learner.holds("agent_0", files)
    assert learner.resume(str(folder), files) == (1, False)
    holds_saved_state(learner)
    assert learner.resume(str(folder), files) == (1, True)    # it holds that folder now
    fresh = Learner(0, tiny_model, learning_rate=1e-2, train_batch_size=2)
    assert fresh.resume(str(folder), files) == (1, False)
    holds_saved_state(fresh)
    other = {**files, "agent_0/model.safetensors": "xxh3_128:" + "0" * 32}
    assert learner.resume(str(folder), other) == (1, False)   # another checkpoint's digests


PROBE = """
import json, os
from workers.engines import ENGINE_ENV
from workers.driver.placement import Placement
from workers.driver.cluster import ensure_ray
from workers.ray_calls import kill_actors, start_actor


class Probe:
    def env(self):
        return {key: os.environ.get(key) for key in ENGINE_ENV}


assert ensure_ray(None, 0, 0.5, quiet=True)
probe = start_actor(Probe, Placement(num_cpus=0.5))
import ray
print(json.dumps({"actor": ray.get(probe.env.remote()), "options": Placement().options(),
                  "driver": {key: os.environ.get(key) for key in ENGINE_ENV}}))
kill_actors([probe])
"""


@pytest.mark.e2e
def test_a_local_ray_gives_actors_the_engine_env_and_leaves_the_driver_as_it_was():
    """On a local Ray the trainer starts, actors get vLLM's variables (ENGINE_ENV) from the
    environment the Ray processes inherit, not from a runtime env (which costs start-up
    time). They still win over the user's own values, as a runtime env's did; the driver's
    own environment is left exactly as it was (no HF_HUB_OFFLINE forced on the user)."""
    import subprocess
    import sys

    from workers.engines import ENGINE_ENV

    env = {k: v for k, v in os.environ.items() if k not in ENGINE_ENV}
    env["VLLM_LOGGING_LEVEL"] = "DEBUG"            # the user's own value
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["actor"] == ENGINE_ENV
    assert "runtime_env" not in seen["options"]
    assert seen["driver"] == {k: ("DEBUG" if k == "VLLM_LOGGING_LEVEL" else None)
                              for k in ENGINE_ENV}


ALLOC_ROUNDS = """
import json, resource, threading, torch
torch.set_num_threads(1)
faults = []
def rounds():                 # in a thread, as an actor's calls run
    for _ in range(12):
        start = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        tensors = [torch.ones(2 * 1024 * 1024) for _ in range(24)]    # 24 x 8 MB
        del tensors
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - start)
worker = threading.Thread(target=rounds)
worker.start()
worker.join()
print(json.dumps(faults))
"""


def test_the_engine_env_keeps_freed_memory_for_the_next_update():
    """An update allocates and frees the same tensors every step (activations, gradients,
    AdamW temporaries). With glibc's defaults, a thread's freed chunks go back to the kernel
    and the next step faults them in again (76.6M: 0.3-2 s of kernel time per update); with
    ENGINE_ENV's GLIBC_TUNABLES the rounds after the first few fault nothing. Both run here,
    so the test also shows the defaults still give memory back on this machine."""
    import subprocess
    import sys

    from workers.engines import ENGINE_ENV

    def fault_rounds(env: dict) -> list[int]:
        proc = subprocess.run([sys.executable, "-c", ALLOC_ROUNDS], env=env, text=True,
                              capture_output=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    default = fault_rounds({**plain, "THP_MEM_ALLOC_ENABLE": ENGINE_ENV["THP_MEM_ALLOC_ENABLE"]})
    ours = fault_rounds({**plain, **ENGINE_ENV})
    assert all(f > default[0] / 4 for f in default[-3:]), default     # faults every round
    assert sum(ours[-3:]) < sum(default[-3:]) / 20, (ours, default)


def test_a_cpu_engine_sizes_its_kv_cache_for_the_runs_largest_call_within_the_cap(tmp_path):
    """Per token a layer keeps K and V: 2 x kv heads x head_dim x dtype bytes; a sequence
    holds whole 128-token blocks of its tokens (the run's longest prompt + max_new_tokens,
    else the engine's longest length), and vLLM keeps one block back and starts only if one
    sequence of the longest length fits; one block is spare. A config it cannot size exactly
    (scaled RoPE, no head count, a dtype it does not know) and any result past the cap get
    the cap, 256 MiB, the fixed size every engine got before. The field is this project's:
    comlrl 1.4.3's MAGRPOConfig (its venv) refuses it with "TypeError:
    MAGRPOConfig.__init__() got an unexpected keyword argument 'kv_cache_memory_bytes'"
    (README)."""
    import json

    from workers.engines import CPU_KV_CACHE_CAP, cpu_kv_cache_bytes

    def model(**cfg):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        base = dict(num_attention_heads=8, num_key_value_heads=4, hidden_size=512,
                    num_hidden_layers=4, max_position_embeddings=512, dtype="float32")
        (folder / "config.json").write_text(json.dumps({**base, **cfg}))
        return str(folder)

    ten_m = model()                   # the 10M benchmark model's shape: 8 KiB per token
    per_token = 2 * 4 * 4 * 64 * 4
    block = 128 * per_token                                 # 1 MiB
    assert cpu_kv_cache_bytes(ten_m, "auto", None, 8) == (8 * 4 + 2) * block
    assert cpu_kv_cache_bytes(ten_m, "bfloat16", None, 8) == (8 * 4 + 2) * block // 2
    assert cpu_kv_cache_bytes(ten_m, "auto", 200, 8) == (8 * 2 + 2) * block
    assert cpu_kv_cache_bytes(model(head_dim=128), "auto", None, 1) == (4 + 2) * block * 2
    assert cpu_kv_cache_bytes(ten_m, "auto", None, 64) == CPU_KV_CACHE_CAP  # 258 MiB
    # The seed run's sequences: a short prompt + 64 new tokens hold one block each.
    assert cpu_kv_cache_bytes(ten_m, "auto", None, 8, tokens=100) == (8 + 2) * block
    assert cpu_kv_cache_bytes(ten_m, "auto", None, 8, tokens=129) == (8 * 2 + 2) * block
    assert cpu_kv_cache_bytes(ten_m, "auto", None, 1, tokens=100) == (4 + 2) * block
    assert cpu_kv_cache_bytes(ten_m, "auto", 200, 8, tokens=1000) == (8 * 2 + 2) * block
    for folder, dtype, sequences in ((model(rope_scaling={"factor": 4.0}), "auto", 8),
                                     (model(rope_parameters={"factor": 2.0}), "auto", 8),
                                     (model(num_attention_heads=None), "auto", 8),
                                     (ten_m, "float8_e4m3fn", 8), (ten_m, "auto", None),
                                     (str(tmp_path / "missing"), "auto", 8)):
        assert cpu_kv_cache_bytes(folder, dtype, None, sequences) == CPU_KV_CACHE_CAP


GC_IMPORTS = """
import gc, json, sys, weakref
from workers.engines import imports_without_gc


class Node:
    pass


def collections():
    return [generation["collections"] for generation in gc.get_stats()]


def since(counts, frozen):
    return [b - a for a, b in zip(counts, collections())] + [gc.get_freeze_count() - frozen]


start = collections(), gc.get_freeze_count()
if sys.argv[1] == "paused":
    with imports_without_gc():
        import torch
        import triton           # nanobind bindings: they report leaks of what stays frozen
        cycle = Node()
        cycle.me = cycle            # garbage only the collector can free
        gone = weakref.ref(cycle)
        del cycle
        paused = not gc.isenabled() and gone() is not None
    first = since(*start)
    between = collections(), gc.get_freeze_count()
    with imports_without_gc():
        import torch            # nothing new: no collection, nothing more frozen
    again = since(*between)
else:
    import torch
    first, paused, gone, again = since(*start), None, lambda: None, None
print(json.dumps({"collections": first[:3], "frozen": first[3], "paused": paused,
                  "enabled": gc.isenabled(), "garbage_freed": gone() is None,
                  "again": again}))
"""


def test_actors_import_their_stack_without_the_collector_then_free_its_garbage_once():
    """Importing torch sets off hundreds of collections, full ones over everything imported so
    far among them (vLLM's imports: 1.5-1.6 of 5.4-5.9 CPU-s per actor start here). Inside
    `imports_without_gc` none runs; leaving it runs one full collection (a cycle made inside
    is freed), freezes the imported objects out of later ones and turns the collector back
    on. At exit they are unfrozen and freed: triton's bindings report no leaks (frozen to
    the end, they reported 4 instances, 64 types and 514 functions leaked). A later block
    that imports nothing new (a warm learner's `reinit`) neither collects nor freezes."""
    import subprocess
    import sys

    def run(mode: str) -> dict:
        proc = subprocess.run([sys.executable, "-c", GC_IMPORTS, mode], cwd=ROOT, text=True,
                              capture_output=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "leaked" not in proc.stderr, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    plain, paused = run("plain"), run("paused")
    assert sum(plain["collections"]) > 100 and plain["collections"][2] >= 1, plain
    assert paused["paused"] and paused["enabled"] and paused["garbage_freed"], paused
    assert paused["collections"] == [0, 0, 1], paused     # the one after the block
    assert paused["frozen"] > 50_000, paused
    assert paused["again"] == [0, 0, 0, 0], paused    # a block that imports nothing new


@pytest.mark.e2e
def test_a_host_keeps_its_engine_and_learner_threads_and_copies_its_weights_in_process(
        ray_session, tiny_model):
    """An agent host (workers/roles/agent_host.py) asked for 1 engine thread and 2 learner
    threads runs each call at its own count, set in the calling thread (vLLM makes
    `torch.set_num_threads` a no-op once its engine has started, and a host's calls run in pool
    threads): a learner call at 2 and an engine call at 1, in either order, in one thread.
    After an update, `load_own_weights` puts the learner's weights into the host's own engine:
    the engine scores a completion as the learner's weights do, and its outputs carry the new
    version."""
    import ray

    from tests.learner_probe import sequence_logprobs
    from workers.roles.agent_host import AgentHost
    from workers.driver.placement import Placement
    from workers.ray_calls import kill_actors, start_actor

    sampling = dict(max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=None,
                    stop_token_ids=(0,))
    host = start_actor(AgentHost, Placement(0.5), 0, tiny_model, "vllm", sampling,
                       dict(kv_cache_memory_bytes=64 << 20, threads=1),
                       dict(learning_rate=1e-2, train_batch_size=2, threads=2))

    def counts(self):
        import torch

        seen = []
        for ready in (self._own_threads, self.engine._ready, self._own_threads):
            ready()
            seen.append(torch.get_num_threads())
        return seen

    try:
        assert ray.get(host.__ray_call__.remote(counts)) == [2, 1, 2]
        prompt = [30, 31, 32, 33]
        out = ray.get(host.generate.remote([{"prompt_ids": prompt, "n": 2, "seed": 3}]))
        assert out["version"] == 0
        comps = [s["token_ids"] for s in out["outputs"][0]]
        before = ray.get(host.prompt_logprobs.remote(prompt + comps[0]))[len(prompt):]
        groups = [{"prompt_ids": prompt, "completions": comps, "returns": [1.0, -1.0]}]
        assert ray.get(host.update.remote(groups, 1))["version"] == 1
        assert ray.get(host.load_own_weights.remote(1)) >= 0
        want = sequence_logprobs(host, tiny_model, prompt, [comps[0]])[0]
        got = ray.get(host.prompt_logprobs.remote(prompt + comps[0]))[len(prompt):]
        assert got == pytest.approx(want, abs=1e-4)
        assert max(abs(a - b) for a, b in zip(got, before)) > 1e-3
        out = ray.get(host.generate.remote([{"prompt_ids": prompt, "n": 2, "seed": 3}]))
        assert out["version"] == 1 and ray.get(host.get_version.remote()) == 1
    finally:
        kill_actors([host])
