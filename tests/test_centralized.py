"""comlrl 1.4.3's CentralizedMAGRPO (issue 38): one joint policy, role responses split for the
reward and the evaluation logger, trained on the vLLM engines with exact resume.

Each docstring says what comlrl 1.4.3 gave for the same call, run in its own virtualenv
(benchmarks/.venv-comlrl, built by benchmarks/bench_seed.py).
"""

from __future__ import annotations

import pytest

from tests.conftest import wandb_history

PROMPTS = ["Describe a city in the clouds:", "Design a playground on Mars:"]


class Adapter:
    """Joins the roles' prompts; the first word of a completion is role 0's answer."""

    def __init__(self, joiner: str = "\n"):
        self.joiner = joiner

    def build_prompt(self, item, role_prompts):
        return "Two roles." + self.joiner + self.joiner.join(role_prompts)

    def parse_completion(self, completion, item, num_roles):
        parts = completion.split(" ", 1)
        return (parts + [""] * num_roles)[:num_roles]


def reward(completions1, completions2, **kwargs):
    return [float(len(a) - len(b)) / 10 for a, b in zip(completions1, completions2)]


FORMATTERS = [lambda row: "A: " + row["prompt"], lambda row: "B: " + row["prompt"]]


def _data():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": PROMPTS, "k": [1, 2]})


def _config(**kw):
    from comlrl.trainers.reinforce import CentralizedMAGRPOConfig

    settings = dict(num_train_epochs=1, num_generations=2, max_new_tokens=8, logging_steps=1,
                    eval_interval=0, verbose=False)
    settings.update(kw)
    return CentralizedMAGRPOConfig(**settings)


# ------------------------------------------------------------------ the config and its checks


def test_config_and_constructor_refuse_what_comlrl_refuses(tiny_model):
    """comlrl 1.4.3, each call in its venv:
    - CentralizedMAGRPOConfig(num_turns=2): ValueError "Centralized MAGRPO currently supports
      num_turns=1 only."; collaboration_mode="decentralized": "CentralizedMAGRPOConfig
      requires centralized collaboration.";
    - the trainer with a plain MAGRPOConfig: "CentralizedMAGRPOTrainer requires centralized
      configuration."; num_agents=3 with args.num_agents=2: "num_agents must match
      args.num_agents (the role count)."; agents=[m, m]: "Centralized collaboration requires
      exactly one actor model."; an adapter without the methods: TypeError
      "centralized_adapter.build_prompt must be callable."; reward_func=None: "reward_func must
      be callable."
    - a valid one: num_agents 1, args.num_agents 2, one formatter and one tokenizer, and the
      prompt 'Two roles.\\nA: Describe a city in the clouds:\\nB: Describe ...'."""
    from comlrl.trainers.reinforce import CentralizedMAGRPOTrainer, MAGRPOConfig

    with pytest.raises(ValueError, match="supports num_turns=1 only"):
        _config(num_turns=2)
    with pytest.raises(ValueError, match="requires centralized collaboration"):
        _config(collaboration_mode="decentralized")

    def build(**kw):
        settings = dict(centralized_adapter=Adapter(), agent_model=tiny_model,
                        reward_func=reward, train_dataset=_data(), args=_config())
        settings.update(kw)
        return CentralizedMAGRPOTrainer(**settings)

    with pytest.raises(ValueError, match="requires centralized configuration"):
        build(args=MAGRPOConfig(num_turns=1))
    with pytest.raises(ValueError, match=r"num_agents must match args.num_agents"):
        build(num_agents=3)
    with pytest.raises(ValueError, match="exactly one actor model"):
        build(agent_model=None, agents=[tiny_model, tiny_model])
    with pytest.raises(TypeError, match="centralized_adapter.build_prompt must be callable"):
        build(centralized_adapter=object())
    with pytest.raises(ValueError, match="reward_func must be callable"):
        build(reward_func=None)
    with pytest.raises(TypeError):                    # comlrl's call form is keywords only
        CentralizedMAGRPOTrainer(Adapter())

    trainer = build(formatters=FORMATTERS)
    assert (trainer.num_agents, trainer.args.num_agents) == (1, 2)
    assert len(trainer.formatters) == 1 and len(trainer.tokenizers) == 1
    assert trainer.formatters[0](_data()[0]) == \
        "Two roles.\nA: Describe a city in the clouds:\nB: Describe a city in the clouds:"


# ------------------------------------------------------------------ the reward (pure logic)


def test_reward_splits_each_completion_and_calls_the_task_reward_as_comlrl_does():
    """comlrl 1.4.3, a reward(completions1, completions2, **kwargs) recording its calls: one
    call per joint completion, each with one-element lists per role, prompts=[role 0's
    formatted prompt], batch_items=[the row]; the reward_processor applies once, to the joint
    reward (the eval mean was 2x the raw reward)."""
    from comlrl.centralized import CentralizedReward

    calls = []

    def recording(completions1, completions2, **kwargs):
        calls.append((completions1, completions2, kwargs))
        return reward(completions1, completions2)

    row = {"prompt": PROMPTS[0], "k": 1}
    collab = CentralizedReward(Adapter(), FORMATTERS, recording, 2)
    out = collab(["abc defgh", "solo"], prompts=["joint"] * 2, batch_items=[row] * 2)
    assert out == [pytest.approx(-0.2), pytest.approx(0.4)]
    assert calls == [(["abc"], ["defgh"], {"prompts": ["A: " + PROMPTS[0]], "batch_items": [row]}),
                     (["solo"], [""], {"prompts": ["A: " + PROMPTS[0]], "batch_items": [row]})]


def test_reward_and_adapter_errors_name_the_adapter_and_the_fix():
    """comlrl 1.4.3 raises "Centralized adapter must return exactly 2 outputs." for a wrong
    count and a TypeError for a bare string; here the same, naming parse_completion. A task
    reward returning NaN is refused as MAGRPO's is."""
    from comlrl.centralized import CentralizedReward

    class Short(Adapter):
        def parse_completion(self, completion, item, num_roles):
            return [completion]

    class Bare(Adapter):
        def parse_completion(self, completion, item, num_roles):
            return completion

    row = {"prompt": PROMPTS[0]}
    with pytest.raises(ValueError, match=r"parse_completion must return exactly 2 outputs"):
        CentralizedReward(Short(), None, reward, 2)(["a b"], batch_items=[row])
    with pytest.raises(TypeError, match="sequence of 2 strings"):
        CentralizedReward(Bare(), None, reward, 2)(["a b"], batch_items=[row])
    with pytest.raises(ValueError, match="not finite"):
        CentralizedReward(Adapter(), None, lambda a, b: [float("nan")], 2)(
            ["a b"], batch_items=[row])

    class Empty(Adapter):
        def build_prompt(self, item, role_prompts):
            return "  "

    with pytest.raises(ValueError, match="build_prompt must return a non-empty string"):
        CentralizedReward(Empty(), None, reward, 2).build_prompt(row)


def test_evaluation_completions_are_split_per_role():
    """comlrl 1.4.3's eval_logger got agent_completions_turns of shape [[1, 1], [1, 1]] for 2
    roles and 2 eval rows: per role, per row, one text per turn, each split as the reward
    splits it."""
    from comlrl.centralized import CentralizedReward

    rows = [{"prompt": p} for p in PROMPTS]
    collab = CentralizedReward(Adapter(), None, reward, 2)
    split = collab.split_eval([[["left right side"], ["alone"]]], rows)
    assert split == [[["left"], ["alone"]], [["right side"], [""]]]


# ------------------------------------------------------------------ end to end


@pytest.mark.e2e
def test_trains_on_vllm_and_resumes_exactly(ray_session, tiny_model, wandb_dir, tmp_path):
    """comlrl 1.4.3, 2 prompts, K=2, 2 epochs: env_step 8, the reward called once per joint
    completion (8 calls), W&B keys turn_1/reward_mean and turn_1/expected_return at steps 4
    and 8, the eval logger given role-split completions. Here the same, on the vLLM engine, and
    1 epoch then a resume to 2 logs the straight run's values bit for bit and ends with its
    weights; a resume with another adapter is refused, naming centralized_adapter."""
    from comlrl.checkpoint import CheckpointError
    from comlrl.trainers.reinforce import CentralizedMAGRPOTrainer
    from comlrl.utils import read_checkpoint_metadata

    calls, logged = [], []

    def counted(completions1, completions2, **kwargs):
        calls.append(1)
        return reward(completions1, completions2)

    def eval_logger(agent_completions_turns, batch_items, prompts):
        logged.append(agent_completions_turns)
        return [{}]

    def build(epochs, name, adapter=None, reward_func=reward):
        return CentralizedMAGRPOTrainer(
            centralized_adapter=adapter or Adapter(), num_agents=2, agent_model=tiny_model,
            reward_func=reward_func, formatters=FORMATTERS, train_dataset=_data(),
            eval_dataset=_data(), eval_logger=eval_logger,
            eval_aggregator=lambda detailed, num_turns: {"turn_1/rows": float(len(detailed))},
            wandb_config={"project": "comlrl-tests", "name": name},
            args=_config(num_train_epochs=epochs, eval_interval=2, eval_num_samples=2))

    # A closure over a growing list fingerprints differently at every call: the counting
    # reward is the straight run's alone (it is never resumed).
    straight = build(2, "straight", reward_func=counted)
    straight.train()
    # One reward call per joint completion: 8 in training, 2 per evaluation (2 rows, 1 sample).
    assert straight.env_step == 8 and logged and len(calls) == 8 + 2 * len(logged)
    assert [[len(turns) for turns in role] for role in logged[-1]] == [[1, 1], [1, 1]]
    assert straight._session is None and straight.last_wandb_identity is not None
    assert straight.args.rollout_engine == "vllm"       # not the HF fallback

    ckpt = tmp_path / "ckpt"
    first = build(1, "resumed")
    first.train(checkpoint_dir=str(ckpt))
    with pytest.raises(CheckpointError, match="centralized_adapter") as refused:
        build(2, "refused", Adapter(joiner="\n\n")).train(
            resume_from_checkpoint=str(ckpt / "checkpoint-1"), checkpoint_dir=str(ckpt))
    assert "reward_func:" not in str(refused.value)       # the adapter alone changed
    resumed = build(2, "resumed")
    resumed.train(resume_from_checkpoint=str(ckpt / "checkpoint-1"), checkpoint_dir=str(ckpt))
    assert resumed.env_step == 8
    run_id = read_checkpoint_metadata(ckpt / "checkpoint-2")["wandb"]["id"]

    def values(run):      # every logged value but the wall-clock ones
        return {(r["_step"], k): v for r in wandb_history(wandb_dir)
                if r["_run"].endswith(run) for k, v in r.items()
                if not k.startswith(("_", "timing/", "throughput/"))}

    straight_id = straight.last_wandb_identity["id"]
    assert values(run_id) == values(straight_id)
    assert {k for _, k in values(straight_id)} >= {
        "turn_1/reward_mean", "turn_1/expected_return", "agent_0/loss",
        "eval/turn_1/reward_mean", "eval/turn_1/rows"}
    assert sorted({s for s, k in values(straight_id) if k == "turn_1/reward_mean"}) == [4, 8]
    for a, b in zip(straight._initial_models()[0].state_dict().values(),
                    resumed._initial_models()[0].state_dict().values()):
        assert a.equal(b)
