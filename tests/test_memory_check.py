"""The memory estimate, the refusal of a run that will not fit, and Ray's OOM report in one
sentence (issue 34). Pure logic of workers/driver/memory.py, no Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.driver.memory import GB, advice, check_fits, estimate
from workers.ray_calls import oom_sentence

REPORT = (Path(__file__).parent / "data" / "ray_oom_report.txt").read_text()
"""What Ray 2.60 raised (OutOfMemoryError) when its monitor killed the 358M seed run here."""


def test_the_estimate_adds_learner_engine_and_processes_per_agent():
    """Two colocated 358M agents, fp32 engines: 12 bytes per parameter of learner weights and
    AdamW, 4 of engine weights, 4 of the final weights in the user's models, the activations'
    share, one process per agent + the driver. At 358M that is above what this machine has
    available (~22.5 GB): the seed run there was killed by Ray at 23.1 GB (BENCHMARKS.md)."""
    p = 358_000_000
    e = estimate([p, p], colocated=True, engines_per_agent=1, engine_bytes_per_param=4,
                 reference=False, kv_cache_bytes=10_000_000)
    assert e.parts["learner weights + AdamW"] == 24 * p
    assert e.parts["engine weights"] == 8 * p
    assert e.parts["KV caches"] == 20_000_000
    assert e.parts["final weights in the user's models"] == 8 * p
    assert e.total == sum(e.parts.values())
    assert 22.5 * GB < e.total < 25 * GB
    split = estimate([p, p], colocated=False, engines_per_agent=2, engine_bytes_per_param=2,
                     reference=True)
    assert split.parts["engine weights"] == 2 * 2 * 2 * p
    assert split.parts["reference models"] == 8 * p
    assert split.parts["processes"] > e.parts["processes"]      # 6 processes against 2



def test_lora_agents_on_one_base_count_one_base_and_one_engine():
    """Four LoRA agents (1% of each model trainable) whose adapters one engine serves (agents
    1-3 engineless): AdamW over the adapters only, the base the learners map once, one
    engine's weights and KV cache, one update's activations (the group's learners take
    turns); four processes still."""
    p, lora = 358_000_000, 3_580_000
    e = estimate([p] * 4, colocated=True, engines_per_agent=1, engine_bytes_per_param=4,
                 reference=False, kv_cache_bytes=10_000_000, trainable=[lora] * 4,
                 engineless=[1, 2, 3], activation_bytes=[100, 200, 300, 400])
    assert e.parts["learner weights + AdamW"] == 4 * p + 8 * 4 * lora
    assert e.parts["activations"] == 100
    assert e.parts["engine weights"] == 4 * p
    assert e.parts["KV caches"] == 10_000_000
    full = estimate([p] * 4, colocated=True, engines_per_agent=1, engine_bytes_per_param=4,
                    reference=False, kv_cache_bytes=10_000_000)
    assert e.parts["processes"] == full.parts["processes"]
    assert full.parts["learner weights + AdamW"] == 48 * p and full.parts["engine weights"] \
        == 16 * p

def test_a_run_that_will_not_fit_is_refused_naming_the_settings_that_help():
    p = 494_000_000
    need = estimate([p] * 4, colocated=False, engines_per_agent=2, engine_bytes_per_param=4,
                    reference=True)
    tips = advice(False, 4, 2, True)
    with pytest.raises(MemoryError) as info:
        check_fits(need, int(20 * GB), num_agents=4, params=[p] * 4, tips=tips)
    text = str(info.value)
    for setting in ("engine_dtype='bfloat16'", "rollout_workers_per_agent=1", "colocate=True",
                    "reference_kl_enabled=False", "memory_check=False"):
        assert setting in text, setting
    assert "20.0 GB available" in text and "494M parameters" in text
    check_fits(need, need.total, num_agents=4, params=[p] * 4, tips=tips)   # fits: silent
    check_fits(need, None, num_agents=4, params=[p] * 4, tips=tips)         # unknown: silent


def test_rays_oom_report_becomes_one_sentence_naming_the_actors_and_their_memory():
    """Ray's page (object store, every worker, advice) becomes one line: the two actors Ray
    selected (not the one it only considered), their memory, the machine's, and the fix."""
    text = oom_sentence("learners", REPORT)
    assert "\n" not in text
    assert text.startswith("learners: Ray's memory monitor killed ")
    assert "Checkpointer (pid 5477, 0.1 GB)" in text and "AgentHost (pid 5436, 10.6 GB)" in text
    assert "5435" not in text                                 # considered, not selected
    assert "22.6 of 23.5 GB in use" in text
    assert "engine_dtype='bfloat16'" in text
    assert oom_sentence("x", "nothing Ray said").startswith("x: Ray's memory monitor killed an actor")


def test_the_activation_estimate_follows_the_mini_batch_and_gradient_checkpointing():
    """At Qwen2.5-0.5B's shape (24 layers, hidden 896, MLP 4864) on the seed example's
    mini-batch (2 prompts x K=4 x 80 tokens): all layers' activations without checkpointing
    (~2 GB per agent, measured 1.82 at 76 tokens), about a quarter with it; the
    real 151936-token vocabulary adds its head (four tensors of the vocabulary's size), which
    checkpointing keeps. Twice the tokens, twice the bytes. The advice names the setting
    with what it saves, after the engine dtype."""
    from types import SimpleNamespace

    from workers.driver.memory import update_activation_bytes

    shape = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24)
    small, real = (SimpleNamespace(**shape, vocab_size=v) for v in (512, 151936))
    plain = update_activation_bytes(small, 640, False)
    replayed = update_activation_bytes(small, 640, True)
    assert 1.8 * GB < plain < 2.2 * GB
    assert replayed < 0.3 * plain
    assert update_activation_bytes(small, 1280, False) == 2 * plain
    head = update_activation_bytes(real, 640, True) - replayed
    assert head == 640 * 4 * 4 * (151936 - 512)
    assert update_activation_bytes(real, 640, False) - plain == head
    tips = advice(True, 4, 1, False, checkpointing_saves=int(3.1 * GB))
    assert tips[0].startswith("engine_dtype='bfloat16'")
    assert tips[1].startswith("gradient_checkpointing=True (about 3.1 GB less")
    assert not any("gradient_checkpointing" in t for t in advice(True, 4, 1, False))
