"""Bad input fails at construction with a ValueError naming the field and the fix."""

from __future__ import annotations

import pytest

from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


def reward(c1, c2):
    return [0.0] * len(c1)


@pytest.mark.parametrize("field,value,match", [
    ("num_generations", 1, "num_generations must be >= 2"),
    ("num_train_epochs", 0, "num_train_epochs must be >= 1"),
    ("rollout_buffer_size", -1, "rollout_buffer_size must be >= 1"),
    ("advantage_mode", "median", "advantage_mode must be one of: mean, raw, max, rloo"),
    ("rollout_engine", "sglang", "rollout_engine must be 'vllm' or 'hf'"),
    ("top_p", 0.0, "top_p must be in"),
    ("temperature", 0.0, "temperature must be > 0"),
    ("eval_interval", -1, "eval_interval must be >= 0"),
    ("logging_steps", 0, "logging_steps must be >= 1"),
    ("gpu_memory_utilization", 1.5, "gpu_memory_utilization"),
])
def test_config_rejects_bad_fields(field, value, match):
    with pytest.raises(ValueError, match=match):
        MAGRPOConfig(**{field: value})


def test_config_defaults_are_comlrls():
    c = MAGRPOConfig()
    assert (c.num_train_epochs, c.agent_learning_rate, c.logging_steps, c.num_agents) == \
        (20, 5e-6, 50, 2)
    assert (c.num_generations, c.max_new_tokens, c.temperature, c.top_p, c.top_k) == \
        (4, 256, 0.6, 0.6, 50)
    assert (c.num_turns, c.discount, c.joint_mode, c.early_termination_threshold) == \
        (2, 1.0, "aligned", -0.2)
    assert (c.eval_interval, c.eval_num_samples, c.eval_batch_size) == (16, 4, 1)
    assert (c.rollout_buffer_size, c.train_batch_size, c.advantage_normalization) == (2, 2, True)
    assert (c.advantage_mode, c.reference_kl_enabled, c.reference_kl_coef) == ("mean", False, 0.1)
    assert c.external_prompt_passthrough is False


@pytest.fixture(scope="module")
def parts(tiny_model):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return {"model": AutoModelForCausalLM.from_pretrained(tiny_model),
            "tokenizer": AutoTokenizer.from_pretrained(tiny_model),
            "data": Dataset.from_dict({"prompt": ["a", "b"]})}


def build(parts, **kw):
    args = dict(agents=[parts["model"], parts["model"]], tokenizer=parts["tokenizer"],
                reward_func=reward, train_dataset=parts["data"], args=MAGRPOConfig(num_turns=1))
    args.update(kw)
    return MAGRPOTrainer(**args)


def test_construction_starts_nothing_heavy(tiny_model):
    """In a fresh process: earlier tests of this session may have started Ray or imported vLLM
    here, which would hide a constructor that does so."""
    import subprocess
    import sys

    code = f"""
import sys
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
model = AutoModelForCausalLM.from_pretrained({tiny_model!r})
MAGRPOTrainer(agents=[model, model], tokenizer=AutoTokenizer.from_pretrained({tiny_model!r}),
              reward_func=lambda a, b: [0.0] * len(a), args=MAGRPOConfig(num_turns=1),
              train_dataset=Dataset.from_dict({{"prompt": ["a", "b"]}}))
ray_up = "ray" in sys.modules and sys.modules["ray"].is_initialized()
print("HEAVY", ray_up, "vllm" in sys.modules, "wandb" in sys.modules and
      sys.modules["wandb"].run is not None)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "HEAVY False False False" in out.stdout, out.stdout


def test_dataset_without_prompt_is_refused(parts):
    from datasets import Dataset

    with pytest.raises(ValueError, match="train_dataset has no 'prompt' column.*rename_column"):
        build(parts, train_dataset=Dataset.from_dict({"text": ["a"]}))


def test_tokenizer_without_eos_is_refused(parts, tiny_model):
    """A tokenizer without eos cannot end a completion. (One without a pad token pads with
    eos, as comlrl 1.4.3 does: tests/test_comlrl_compat_train.py.)"""
    from transformers import AutoTokenizer

    no_eos = AutoTokenizer.from_pretrained(tiny_model)
    no_eos.eos_token = None
    with pytest.raises(ValueError, match="tokenizer 0 has no eos_token"):
        build(parts, tokenizer=no_eos)


def test_other_misuse_keeps_comlrls_error_words(parts):
    with pytest.raises(ValueError, match="Either agent_model or agents must be provided"):
        MAGRPOTrainer(tokenizer=parts["tokenizer"], reward_func=reward,
                      train_dataset=parts["data"])
    with pytest.raises(ValueError, match="reward_func must be a callable"):
        build(parts, reward_func=None)
    with pytest.raises(ValueError, match="Multi-turn MAGRPO requires an external_transition"):
        build(parts, args=MAGRPOConfig(num_turns=2))
    with pytest.raises(ValueError, match="one list of completions per agent"):
        build(parts, reward_func=lambda: [0.0])   # comlrl accepts (prompts, c1, c2) forms
    with pytest.raises(ValueError, match="Unsupported joint_mode"):
        build(parts, args=MAGRPOConfig(num_turns=1, joint_mode="diagonal"))
    with pytest.raises(ValueError, match="Number of formatters must match num_agents"):
        build(parts, formatters=[lambda r: r["prompt"]])


def test_unreachable_ray_address_fails_fast_with_the_fix():
    """In its own process: this pytest process may already be connected to a Ray."""
    import os
    import subprocess
    import sys
    import time

    code = ("from workers.driver.cluster import ensure_ray\n"
            "try:\n    ensure_ray('127.0.0.1:1')\n"
            "except ConnectionError as e:\n    print('ERR', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    start = time.time()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert time.time() - start < 30
    assert "ERR could not reach the Ray cluster at ray_address='127.0.0.1:1'" in out.stdout
    assert "ray start --head" in out.stdout


_EXIT_SCRIPT = """
import atexit, os, ray
from workers.driver.cluster import ensure_ray

def children():
    kids = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\\0", b" ").decode()
        except OSError:
            continue
        if parent == os.getpid():
            kids[int(entry)] = command
    return kids

def after_our_hook():      # registered before ensure_ray's hook, so it runs after it
    print("AFTER", ray.is_initialized(), sorted(children()), flush=True)

atexit.register(after_our_hook)
assert ensure_ray(None) is True
kids = children()
monitor = [pid for pid, command in kids.items() if "autoscaler/_private/monitor.py" in command]
print("KIDS", sorted(kids), "MONITOR", monitor, flush=True)
"""


def test_a_local_ray_is_stopped_at_exit_by_our_hook_which_spares_a_ray_it_did_not_start(
        ray_session):
    """`workers.driver.cluster.stop_local_ray`, registered when the trainer starts a local Ray: at
    exit it stops that Ray before Ray's own hook would (which sleeps 0.5 s, then waits 1 s on
    the autoscaler monitor; bench_seed.py's whole-example table, exit column), killing the
    monitor first, and leaves no Ray process behind. It never stops a Ray this process did
    not start: here the session's, started by conftest."""
    import os
    import subprocess
    import sys

    from workers.driver.cluster import stop_local_ray

    stop_local_ray()
    assert ray_session.is_initialized() and ray_session.get(ray_session.put(7)) == 7
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    kids_line = next(line for line in out.stdout.splitlines() if line.startswith("KIDS"))
    kids = [int(x) for x in kids_line.split("[", 1)[1].split("]", 1)[0].split(",")]
    monitor = kids_line.rsplit("MONITOR", 1)[1]
    assert len(kids) >= 4 and monitor.strip() != "[]", out.stdout   # gcs, raylet, monitor, ...
    # Ray stopped by our hook: after it, no child of the script is left running.
    assert "AFTER False []" in out.stdout, out.stdout
    alive = [pid for pid in kids if os.path.exists(f"/proc/{pid}")
             and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
    assert not alive, f"Ray processes left running after the script exited: {alive}"
