"""Rollout-tree logic (pure): sizes, early termination, returns, env_step order, histories.

A fake engine stands in for generation here only: these are unit tests of the tree logic;
tests/test_multiturn.py runs the same code on real vLLM engines.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from comlrl.config import MAGRPOConfig
from comlrl.rollout import StepRecord, run_episode_batch


class FakeTokenizer:
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(ch) % 50 + 1 for ch in text] or [1]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + i) for i in ids if i != 0)


class FakeSession:
    """Completion k of a request has k+1 tokens, so lengths (and rewards) are known."""

    def __init__(self):
        self.calls = []

    def generate(self, requests_per_agent, record):
        self.calls.append([len(r) for r in requests_per_agent])
        return [[[{"token_ids": [a + 1] * (k + 1) + [0], "logprobs": []} for k in range(r["n"])]
                 for r in reqs] for a, reqs in enumerate(requests_per_agent)]


def make_trainer(reward, transition=None, **cfg):
    args = MAGRPOConfig(num_generations=2, **cfg)
    tok = FakeTokenizer()
    return SimpleNamespace(
        args=args, num_agents=2, tokenizers=[tok, tok], env_step=0,
        formatters=[lambda row, external_prompts=None: external_prompts or row["prompt"]] * 2,
        reward_func=reward, reward_style={"prompts": False, "batch_items": False},
        reward_processor=None, external_transition=transition,
        train_rows=[{"prompt": "p0"}, {"prompt": "p1"}])


def sum_len_reward(c1, c2):
    return [float(len(a) + len(b)) for a, b in zip(c1, c2)]


@pytest.mark.parametrize("discount", [1.0, 0.5])
def test_two_turn_tree_returns_env_steps_and_histories(discount):
    calls = []

    def transition(prompt, agent_completions, num_agents, prompt_history_per_agent,
                   response_history_per_agent):
        calls.append((prompt, list(agent_completions), prompt_history_per_agent,
                      response_history_per_agent))
        return [f"o:{agent_completions[1]}", f"o:{agent_completions[0]}"]

    trainer = make_trainer(sum_len_reward, transition, num_turns=2, discount=discount,
                           early_termination_threshold=None)
    session = FakeSession()
    eps = run_episode_batch(trainer, session, 0, [0, 1], StepRecord())
    # One engine round per turn: 2 roots, then 2 x 2 children, for each agent.
    assert session.calls == [[2, 2], [4, 4]]
    # Agent a's completion k decodes to k+1 copies of chr(97 + a): 'a'/'aa', 'b'/'bb'.
    root = eps[0].root
    assert root.texts == [["a", "aa"], ["b", "bb"]]
    assert root.rewards == [2.0, 4.0]
    # Children see the other agent's answer: prompts 'o:b' / 'o:a' (joint action 0).
    child0 = root.children[0]
    assert child0.prompts == ["o:b", "o:a"]
    assert child0.rewards == [2.0, 4.0]            # completions do not depend on prompts here
    assert root.returns == [2.0 + discount * 3.0, 4.0 + discount * 3.0]
    # env_step is numbered depth-first per prompt: root (2), child 0 (2), child 1 (2).
    assert [n.env_step for n in eps[0].nodes] == [2, 4, 6]
    assert [n.env_step for n in eps[1].nodes] == [8, 10, 12]
    assert eps[1].env_step_before == 6 and trainer.env_step == 12
    # Histories: this turn's prompts, and the joint action's completions (comlrl's).
    prompt, chosen, ph, rh = calls[1]
    assert (prompt, chosen) == ("p0", ["aa", "bb"])
    assert ph == [["p0"], ["p0"]] and rh == [["aa"], ["bb"]]
    assert child0.prompt_history == [["p0", "o:b"], ["p0", "o:a"]]


def test_early_termination_stops_a_branch_whose_mean_reward_exceeds_the_threshold():
    trainer = make_trainer(sum_len_reward, lambda **kw: ["x", "y"], num_turns=3,
                           early_termination_threshold=2.5)
    eps = run_episode_batch(trainer, FakeSession(), 0, [0], StepRecord())
    # Root mean reward 3.0 > 2.5: not expanded; env_step counts the root only.
    assert len(eps[0].nodes) == 1 and trainer.env_step == 2
    trainer = make_trainer(sum_len_reward, lambda **kw: ["x", "y"], num_turns=3,
                           early_termination_threshold=3.0)
    eps = run_episode_batch(trainer, FakeSession(), 0, [0], StepRecord())
    # 3.0 does not exceed 3.0: expanded to depth 3 -> 1 + 2 + 4 nodes, 14 joint rewards.
    assert len(eps[0].nodes) == 7 and trainer.env_step == 14


def test_cross_mode_calls_reward_once_with_k_to_the_n_joint_actions():
    seen = []

    def reward(c1, c2):
        seen.append((list(c1), list(c2)))
        return [float(len(a) * 10 + len(b)) for a, b in zip(c1, c2)]

    trainer = make_trainer(reward, num_turns=1, joint_mode="cross")
    eps = run_episode_batch(trainer, FakeSession(), 0, [0], StepRecord())
    assert seen == [(["a", "a", "aa", "aa"], ["b", "bb", "b", "bb"])]
    assert trainer.env_step == 4
    groups = eps[0].learner_groups(0, trainer.args)
    # agent 0 completion 0 is in joint actions (0,0),(0,1): 11 + 12; completion 1: 21 + 22
    assert groups[0]["returns"] == [23.0, 43.0]
    assert eps[0].learner_groups(1, trainer.args)[0]["returns"] == [11.0 + 21.0, 12.0 + 22.0]


def test_evaluation_returns_are_discounted_like_training_returns():
    """Training returns use `discount` (reward + discount * mean child return); evaluation's
    expected_return from turn t must use it too, or the two disagree (comlrl 1.4.3 ignores
    `discount` in both). One sampled path: rewards r1, r2 give r1 + 0.5 * r2 at turn 1."""
    from comlrl.evaluation import run_evaluation

    def transition(prompt, agent_completions, num_agents, prompt_history_per_agent,
                   response_history_per_agent):
        return ["next one", "next two"]

    trainer = make_trainer(sum_len_reward, transition, num_turns=2, discount=0.5,
                           early_termination_threshold=None, eval_batch_size=2)
    trainer.eval_rows, trainer.eval_logger, trainer.eval_aggregator = (
        trainer.train_rows, None, None)
    metrics = run_evaluation(trainer, FakeSession(), 2)
    # One sample per agent: completion 0 has 1 token per agent, so every reward is 2.0.
    assert metrics["eval/turn_1/reward_mean"] == metrics["eval/turn_2/reward_mean"] == 2.0
    assert metrics["eval/turn_2/expected_return"] == 2.0
    assert metrics["eval/turn_1/expected_return"] == 2.0 + 0.5 * 2.0


class CountingSession(FakeSession):
    """FakeSession that also keeps the sequences (sum of n) each agent got per call."""

    def generate(self, requests_per_agent, record):
        self.sequences = getattr(self, "sequences", []) + [
            sum(r["n"] for r in reqs) for reqs in requests_per_agent]
        self.prompt_tokens = getattr(self, "prompt_tokens", []) + [
            len(r["prompt_ids"]) for reqs in requests_per_agent for r in reqs]
        return super().generate(requests_per_agent, record)


@pytest.mark.parametrize("cfg, rows, evaluation", [
    (dict(num_turns=1, rollout_buffer_size=3), 3, False),           # single turn: a buffer
    (dict(num_turns=3, joint_mode="aligned"), 1, False),            # multi-turn: one prompt
    (dict(num_turns=2, joint_mode="cross"), 1, False),              # K^N children per node
    (dict(num_turns=2, eval_batch_size=5), 5, True),                # evaluation, sampled once
])
def test_sequences_per_call_is_the_most_one_engine_call_of_the_run_holds(cfg, rows, evaluation):
    """The CPU KV cache is sized from `sequences_per_call` (`cpu_kv_cache_bytes`): the tree
    grown here (every node expanded) sends exactly that many sequences to an agent in its
    largest call."""
    from comlrl.rollout import sequences_per_call

    trainer = make_trainer(sum_len_reward, lambda **kw: ["next", "next"],
                           early_termination_threshold=None, **cfg)
    session = CountingSession()
    run_episode_batch(trainer, session, 0, list(range(rows)), StepRecord(),
                      rows=[{"prompt": f"p{i}"} for i in range(rows)],
                      num_generations=1 if evaluation else None, evaluation=evaluation)
    assert max(session.sequences) == sequences_per_call(trainer.args, trainer.num_agents)


def test_longest_sequence_is_the_longest_prompt_an_engine_gets_plus_max_new_tokens():
    """The CPU KV cache holds each sequence in blocks of `longest_sequence` tokens: the
    longest prompt any agent gets, training or evaluating, plus max_new_tokens (here the
    longest row is an eval row). Unknown (None) in a multi-turn run, past PROMPT_SCAN_LIMIT
    prompts, or with a user's formatter, which it never calls: comlrl 1.4.3 (its venv, 2
    rows, 2 agents, 1 epoch of 0.43M) called the formatters 4 times in all, none before
    train(), and so does this project's train()."""
    from comlrl import rollout
    from comlrl.evaluation import run_evaluation
    from comlrl.inputs import build_formatters

    trainer = make_trainer(sum_len_reward, num_turns=1, rollout_buffer_size=3, max_new_tokens=7,
                           eval_batch_size=2)
    trainer.formatters = build_formatters(None, 2)
    trainer.train_rows = [{"prompt": "a" * n} for n in (3, 11, 5)]
    trainer.eval_rows = [{"prompt": "b" * n} for n in (4, 13)]
    trainer.eval_logger = trainer.eval_aggregator = None
    session = CountingSession()
    run_episode_batch(trainer, session, 0, [0, 1, 2], StepRecord())
    run_evaluation(trainer, session)
    assert max(session.prompt_tokens) == 13
    assert rollout.longest_sequence(trainer) == 13 + 7

    trainer.args.num_turns = 2
    assert rollout.longest_sequence(trainer) is None
    trainer.args.num_turns = 1
    trainer.eval_rows = None                  # 2 agents: two prompts per row
    trainer.train_rows = [{"prompt": "a"}] * (rollout.PROMPT_SCAN_LIMIT // 2)
    assert rollout.longest_sequence(trainer) == 1 + 7
    trainer.train_rows.append({"prompt": "a"})
    assert rollout.longest_sequence(trainer) is None
    trainer.train_rows = [{"prompt": "a"}]

    calls = []
    trainer.formatters = build_formatters(lambda row: calls.append(row) or row["prompt"], 2)
    assert rollout.longest_sequence(trainer) is None and calls == []
