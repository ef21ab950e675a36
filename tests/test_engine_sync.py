"""A real vLLM engine in a Ray actor tracks the learner's weights after every update."""

from __future__ import annotations

import pytest

from comlrl import magrpo
from tests.learner_probe import sequence_logprobs

pytestmark = pytest.mark.e2e


def _start(tiny_model, engine):
    from workers.launch import Placement, start_actor
    from workers.learner import Learner
    from workers.rollout import RolloutWorker

    sampling = dict(max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=None,
                    stop_token_ids=(0,))
    worker = start_actor(RolloutWorker, Placement(0.5), 0, tiny_model, engine, sampling,
                         dict(kv_cache_memory_bytes=64 << 20, threads=1))
    learner = start_actor(Learner, Placement(0.5), 0, tiny_model, learning_rate=1e-2,
                          train_batch_size=2, threads=1)
    return worker, learner


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_engine_logprobs_follow_learner_after_update(ray_session, tiny_model, engine):
    import ray

    from workers.launch import kill_actors

    worker, learner = _start(tiny_model, engine)
    try:
        prompt = [30, 31, 32, 33, 34]
        out = ray.get(worker.generate.remote(
            [{"prompt_ids": prompt, "n": 3, "seed": 7, "logprobs": True}]))
        assert out["version"] == 0
        samples = out["outputs"][0]
        assert len(samples) == 3 and all(len(s["token_ids"]) >= 1 for s in samples)
        comps = [magrpo.trim_at_eos(s["token_ids"], {0}) for s in samples]
        # Training never reads log-probs, so they are computed only when asked for; asking
        # does not change what is sampled.
        plain = ray.get(worker.generate.remote(
            [{"prompt_ids": prompt, "n": 3, "seed": 7}]))["outputs"][0]
        assert [s["token_ids"] for s in plain] == [s["token_ids"] for s in samples]
        assert all("logprobs" not in s for s in plain)
        # Sampling logprobs are the learner's teacher-forced log-probs for the same weights.
        before = sequence_logprobs(learner, tiny_model, prompt, comps)
        for s, lp in zip(samples, before):
            assert s["logprobs"][:len(lp)] == pytest.approx(lp, abs=1e-4)
        fixed = prompt + comps[0]
        engine_before = ray.get(worker.prompt_logprobs.remote(fixed))[len(prompt):]

        groups = [{"prompt_ids": prompt, "completions": comps, "returns": [1.0, -0.5, -0.5]},
                  {"prompt_ids": prompt[:3], "completions": comps[:2], "returns": [1.0, -1.0]}]
        res = ray.get(learner.update.remote(groups, 123))
        assert res["version"] == 1 and res["trained_tokens"] > 0
        ray.get(worker.update_weights.remote(res["version"], learner.get_weights.remote()))
        assert ray.get(worker.get_version.remote()) == 1

        after_learner = sequence_logprobs(learner, tiny_model, prompt, [comps[0]])[0]
        engine_after = ray.get(worker.prompt_logprobs.remote(fixed))[len(prompt):]
        assert engine_after == pytest.approx(after_learner, abs=1e-4)
        assert max(abs(a - b) for a, b in zip(engine_after, engine_before)) > 1e-3
        # New rollouts are tagged with the version that drew them.
        again = ray.get(worker.generate.remote([{"prompt_ids": prompt, "n": 2, "seed": 7}]))
        assert again["version"] == 1
    finally:
        kill_actors([worker, learner])


def test_same_seed_same_samples_across_calls_and_batches(ray_session, tiny_model):
    import ray

    from workers.launch import kill_actors

    worker, learner = _start(tiny_model, "vllm")
    try:
        reqs = [{"prompt_ids": [30 + i, 31, 32], "n": 4, "seed": 100 + 10 * i} for i in range(4)]
        together = ray.get(worker.generate.remote(reqs))["outputs"]
        one_by_one = [ray.get(worker.generate.remote([r]))["outputs"][0] for r in reversed(reqs)]
        assert [[s["token_ids"] for s in o] for o in together] == \
            [[s["token_ids"] for s in o] for o in reversed(one_by_one)]
        other = ray.get(worker.generate.remote([{**reqs[0], "seed": 999}]))["outputs"][0]
        assert [s["token_ids"] for s in other] != [s["token_ids"] for s in together[0]]
    finally:
        kill_actors([worker, learner])
