"""comlrl's other MAGRPO options on real vLLM engines: multi-turn, cross mode, evaluation,
reference KL, homogeneous agents, save_model, and a multi-turn resume."""

from __future__ import annotations

import math

import pytest

from tests.conftest import wandb_history

pytestmark = pytest.mark.e2e

TWO_PROMPTS = ["Describe a city in the clouds:", "Design a playground on Mars:"]
FOUR_PROMPTS = TWO_PROMPTS + ["Invent a new holiday:", "Write a bedtime story:"]


class Recorder:
    """A reward and a transition that remember every call, to work the values out by hand."""

    def __init__(self):
        self.rewards, self.transitions = [], []

    def reward(self, completions1, completions2):
        out = [len(a) / 10.0 - len(b) / 20.0 for a, b in zip(completions1, completions2)]
        self.rewards.append((list(completions1), list(completions2), out))
        return out

    def transition(self, prompt, agent_completions, num_agents, prompt_history_per_agent,
                   response_history_per_agent):
        self.transitions.append(dict(prompt=prompt, chosen=list(agent_completions),
                                     num_agents=num_agents, ph=prompt_history_per_agent,
                                     rh=response_history_per_agent))
        # Each agent is shown the other's answer.
        return [f"Other: {agent_completions[1]}", f"Other: {agent_completions[0]}"]


def trainer_for(tiny_model, prompts, reward, *, wandb=True, **cfg):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

    settings = dict(num_generations=2, max_new_tokens=8, logging_steps=1, num_train_epochs=1,
                    temperature=1.0, top_p=1.0, top_k=None)
    extra = {k: cfg.pop(k) for k in list(cfg) if k in ("external_transition", "eval_dataset",
                                                        "agent_model", "num_agents")}
    models = cfg.pop("models", [tiny_model, tiny_model])
    settings.update(cfg)
    if "agent_model" not in extra:
        extra["agents"] = [AutoModelForCausalLM.from_pretrained(m) for m in models]
    tokenizers = [AutoTokenizer.from_pretrained(m) for m in models]
    return MAGRPOTrainer(tokenizer=tokenizers, reward_func=reward,
                         train_dataset=Dataset.from_dict({"prompt": prompts}),
                         args=MAGRPOConfig(**settings),
                         wandb_config={"project": "comlrl-tests"} if wandb else None, **extra)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> str:
    """A second architecture (1 layer, hidden 64, its own tokenizer files)."""
    from comlrl.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("small") / "m", seed=3, hidden_size=64,
                                num_layers=1, num_heads=2, num_kv_heads=1))


@pytest.mark.parametrize("discount", [1.0, 0.5])
def test_two_turn_tree_matches_values_worked_out_by_hand(ray_session, tiny_model, small_model,
                                                         wandb_dir, discount):
    rec = Recorder()
    # discount 0.5 also runs agents of different architectures, a tokenizer each.
    models = [tiny_model, small_model] if discount == 0.5 else [tiny_model, tiny_model]
    trainer = trainer_for(tiny_model, TWO_PROMPTS, rec.reward, num_turns=2, discount=discount,
                          models=models,
                          early_termination_threshold=None, external_transition=rec.transition)
    trainer.train()
    # Per prompt: a root (K=2 joint rewards) and one child per joint action (2 x 2). As in
    # comlrl, a prompt's whole tree is grown before the next prompt is sampled.
    assert len(rec.rewards) == 2 + 4 and all(len(r[2]) == 2 for r in rec.rewards)
    assert len(rec.transitions) == 4
    assert trainer.env_step == 2 * (2 + 2 * 2)
    roots = [rec.rewards[0], rec.rewards[3]]
    children = [rec.rewards[1], rec.rewards[2], rec.rewards[4], rec.rewards[5]]
    for t_i, tr in enumerate(rec.transitions):
        p, j = divmod(t_i, 2)
        c1, c2, _ = roots[p]
        assert tr["prompt"] == TWO_PROMPTS[p] and tr["num_agents"] == 2
        assert tr["chosen"] == [c1[j], c2[j]]
        assert tr["ph"] == [[TWO_PROMPTS[p]], [TWO_PROMPTS[p]]]
        assert tr["rh"] == [[c1[j]], [c2[j]]]
    # Returns by hand: root return j = reward j + discount * mean(child j's rewards).
    root_returns = []
    for p in range(2):
        r = roots[p][2]
        root_returns.append([r[j] + discount * sum(children[2 * p + j][2]) / 2 for j in range(2)])
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    # Updates every 2 tree nodes (comlrl's rollout_buffer_size counts nodes), each logged at
    # its newest node's env_step: {p1 root, p1 child 0} at 4, {p1 child 1, p2 root} at 8,
    # {p2 child 0, p2 child 1} at 12.
    history = {h["_step"]: h for h in wandb_history(wandb_dir)}
    assert sorted(history) == [4, 8, 12]
    for step, p in ((4, 0), (8, 1)):
        h = history[step]
        assert h["turn_1/reward_mean"] == pytest.approx(mean(roots[p][2]), abs=1e-9)
        assert h["turn_1/expected_return"] == pytest.approx(mean(root_returns[p]), abs=1e-9)
        assert h["turn_2/reward_mean"] == pytest.approx(mean(children[p][2]), abs=1e-9)
        assert h["turn_2/expected_return"] == pytest.approx(h["turn_2/reward_mean"], abs=1e-9)
    assert "turn_1/reward_mean" not in history[12]
    assert history[12]["turn_2/reward_mean"] == pytest.approx(
        mean([mean(children[2][2]), mean(children[3][2])]), abs=1e-9)


def test_cross_mode_nine_joint_rewards_per_prompt(ray_session, tiny_model, wandb_dir):
    seen = []

    def reward(completions1, completions2):
        seen.append((list(completions1), list(completions2)))
        return [float(len(a) - len(b)) for a, b in zip(completions1, completions2)]

    trainer = trainer_for(tiny_model, TWO_PROMPTS, reward, num_turns=1, num_generations=3,
                          joint_mode="crossed", agent_model=tiny_model, num_agents=2)
    trainer.train()
    assert len(seen) == 2 and all(len(c1) == 9 for c1, _ in seen)
    for c1, c2 in seen:
        # itertools.product order: agent 0's completion i with agent 1's completion j.
        firsts, seconds = c1[::3], c2[:3]
        assert c1 == [firsts[i] for i in range(3) for _ in range(3)]
        assert c2 == seconds * 3
    assert trainer.env_step == 18
    assert [h["_step"] for h in wandb_history(wandb_dir)] == [18]


TRAIN_KEYS = ("turn_1/reward_mean", "turn_1/expected_return", "agent_0/loss", "agent_1/loss",
              "agent_0/completion_length", "agent_1/completion_length",
              "turn_1/reference_kl_mean")


def test_evaluation_logs_eval_keys_and_leaves_training_unchanged(ray_session, tiny_model,
                                                                 tmp_path, monkeypatch):
    from datasets import Dataset

    def reward(completions1, completions2):
        return [len(a) / 10.0 + len(b) / 10.0 for a, b in zip(completions1, completions2)]

    runs = {}
    for name, eval_on in (("off", False), ("on", True)):
        d = tmp_path / name
        d.mkdir()
        monkeypatch.setenv("WANDB_DIR", str(d))
        extra = {"eval_dataset": Dataset.from_dict({"prompt": ["Eval one:", "Eval two:"]})} \
            if eval_on else {}
        trainer = trainer_for(tiny_model, FOUR_PROMPTS, reward, num_turns=1, num_train_epochs=2,
                              eval_interval=2, eval_num_samples=2, reference_kl_enabled=True,
                              agent_learning_rate=1e-2, **extra)
        trainer.train()
        runs[name] = {h["_step"]: h for h in wandb_history(d)}
    off, on = runs["off"], runs["on"]
    assert sorted(off) == [4, 8, 12, 16]      # K=2: +2 per prompt, an update every 2 prompts
    # Evaluation before prompts 0 and 2 of each epoch: step 0 alone, then with each step's line.
    assert sorted(on) == [0, 4, 8, 12, 16]
    for step in (0, 4, 8, 12, 16):
        assert "eval/turn_1/reward_mean" in on[step] and "eval/turn_1/expected_return" in on[step]
    for step in off:
        for key in TRAIN_KEYS:
            assert on[step][key] == off[step][key], (step, key)
    # Reference KL: exactly zero while the policy is the reference, then it grows.
    kl = [off[s]["turn_1/reference_kl_mean"] for s in sorted(off)]
    assert kl[0] == 0.0 and kl[1] > 0.0 and kl[-1] > kl[1], kl
    assert off[8]["turn_1/reference_kl_penalty_mean"] == pytest.approx(0.1 * kl[1])


def test_multiturn_resume_is_bit_identical_and_save_model_loads(ray_session, tiny_model,
                                                                tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    from comlrl.utils import read_checkpoint_metadata

    def run(name, epochs, resume=None, ckpt=None):
        d = tmp_path / name
        d.mkdir(exist_ok=True)
        monkeypatch.setenv("WANDB_DIR", str(d))
        rec = Recorder()
        trainer = trainer_for(tiny_model, TWO_PROMPTS, rec.reward, num_turns=2,
                              num_train_epochs=epochs, early_termination_threshold=0.2,
                              external_transition=rec.transition)
        if resume:
            trainer.wandb_config = {**trainer.wandb_config,
                                    **read_checkpoint_metadata(resume)["wandb"],
                                    "resume": "allow"}
        trainer.train(checkpoint_dir=str(ckpt or d / "ckpt"), resume_from_checkpoint=resume)
        return trainer, d

    straight, sd = run("straight", 2)
    first, fd = run("split", 1)
    second, _ = run("split", 2, resume=str(fd / "ckpt" / "checkpoint-1"), ckpt=fd / "ckpt")
    want = {h["_step"]: h for h in wandb_history(sd)}
    got = {}
    for h in wandb_history(fd):
        assert h["_step"] not in got
        got[h["_step"]] = h
    assert sorted(got) == sorted(want) and len(want) == 2
    for step, h in want.items():
        for key, value in h.items():
            if key.startswith(("turn_", "agent_")):
                assert got[step][key] == value, (step, key)
    assert second.env_step == straight.env_step
    for a, b in zip(straight.agents[0].state_dict().values(),
                    second.agents[0].state_dict().values()):
        assert torch.equal(a, b)
    # save_model: one from_pretrained folder per agent, holding the trained weights.
    paths = second.save_model(str(tmp_path / "saved"))
    assert [p.rsplit("/", 1)[1] for p in paths] == ["agent_0", "agent_1"]
    loaded = AutoModelForCausalLM.from_pretrained(paths[1])
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, second.agents[1](ids).logits)
    assert not math.isnan(float(want[max(want)]["turn_1/reward_mean"]))


@pytest.mark.parametrize("buffer,batch,want", [
    # comlrl 1.4.3, run on a tiny model with optimizer.step and generation recorded
    # (2 prompts, 2 turns, K=2, no early termination): rollout_buffer_size counts tree nodes;
    # a full buffer is drained part-way through the data, one optimizer step per turn present
    # (per train_batch_size groups), the rest at the epoch's end. Per agent:
    (2, None, ["sample 0", [0, 1], "sample 1", [0, 1], [1]]),      # 5 steps
    (1, None, ["sample 0", [0], [1], [1], "sample 1", [0], [1], [1]]),  # 6 steps
    (2, 1, ["sample 0", [0, 1], "sample 1", [0, 1], [1, 1]]),      # 6 steps
])
def test_multiturn_update_cadence_matches_comlrl(ray_session, tiny_model, monkeypatch,
                                                 buffer, batch, want):
    """The number and order of optimizer steps, and where prompts are sampled between them,
    are comlrl's: e.g. with rollout_buffer_size=2, comlrl samples prompt 1's tree, steps on
    its root and first child, samples prompt 2, steps on prompt 1's second child and prompt
    2's root, then on prompt 2's children (5 steps per agent, prompt 2 drawn after 2)."""
    import comlrl.trainers.reinforce.magrpo as trainer_module
    from workers.driver.session import Session

    events = []
    sample = trainer_module.run_episode_batch
    update = Session.update_and_push

    def sample_and_note(trainer, session, epoch, rows, record, **kw):
        events.extend(f"sample {i}" for i in rows)
        return sample(trainer, session, epoch, rows, record, **kw)

    def update_and_note(session, nodes, record):
        update(session, nodes, record)
        steps = [res["optimizer_steps"] for res in record.learner]
        assert steps[0] == steps[1]          # both agents take the same steps
        events.append(steps[0])

    monkeypatch.setattr(trainer_module, "run_episode_batch", sample_and_note)
    monkeypatch.setattr(Session, "update_and_push", update_and_note)
    rec = Recorder()
    trainer = trainer_for(tiny_model, TWO_PROMPTS, rec.reward, wandb=False, num_turns=2,
                          early_termination_threshold=None, external_transition=rec.transition,
                          rollout_buffer_size=buffer, train_batch_size=batch)
    trainer.train()
    assert events == want
