"""Rollout trees: expand every prompt of a step turn by turn, one engine call per agent per turn.

A prompt's episode is a tree. Its root holds each agent's K completions for the prompt; its
joint actions get one reward each. In multi-turn runs every joint action of a node whose mean
reward does not exceed `early_termination_threshold` gets a child, whose prompts come from
`external_transition`. All nodes of a turn, across all prompts of the step, are generated in a
single round of engine calls. env_step is then numbered depth-first per prompt, as comlrl does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from comlrl import magrpo, rewards


@dataclass
class StepRecord:
    """What one training step measured (seconds, tokens, versions, learner results), for its
    log line."""

    generation: float = 0.0
    learning: float = 0.0
    weight_sync: float = 0.0
    tokens: int = 0
    policy_versions: dict = field(default_factory=dict)      # agent -> weight version that sampled
    learner: list = field(default_factory=list)


@dataclass
class Node:
    turn: int
    path: tuple
    prompts: list[str]                      # per agent, the text each agent was given
    prompt_history: list[list[str]]         # per agent, prompts up to and including this turn
    response_history: list[list[str]]       # per agent, chosen responses before this turn
    prompt_ids: list[list[int]] = field(default_factory=list)
    token_ids: list[list[list[int]]] = field(default_factory=list)   # [agent][k], cut after EOS
    texts: list[list[str]] = field(default_factory=list)             # [agent][k]
    combos: list[tuple] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    returns: list[float] = field(default_factory=list)
    children: dict = field(default_factory=dict)                     # joint action -> Node
    env_step: int = 0


@dataclass
class Episode:
    row_index: int
    row: dict
    root: Node
    env_step_before: int = 0

    @property
    def nodes(self) -> list[Node]:
        """Depth-first pre-order: the order comlrl numbers env_steps in."""
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children[j] for j in sorted(node.children, reverse=True))
        return out

    def learner_groups(self, agent: int, args: Any) -> list[dict]:
        """One group per node of this episode for `agent` (`learner_group`)."""
        return [learner_group(node, agent, args) for node in self.nodes]


def learner_group(node: Node, agent: int, args: Any) -> dict:
    """What `agent`'s learner trains on for one node: its K completions and their returns.

    The learner turns returns into advantages (after the reference-KL penalty, which needs the
    learner's models)."""
    k = len(node.token_ids[agent])
    return {"prompt_ids": node.prompt_ids[agent], "completions": node.token_ids[agent],
            "returns": magrpo.per_agent_returns(node.returns, node.combos, agent, k, args.cross),
            "turn": node.turn}


def format_prompt(trainer: Any, agent: int, row: dict, external: str | None) -> str:
    """The text agent `agent` is given: its formatter's, or the transition's as it is."""
    if external is not None and trainer.args.external_prompt_passthrough:
        return external
    if external is not None:
        # comlrl hands formatters the row with 'prompt' replaced by the transition's prompt.
        row = {**row, "prompt": external}
    return trainer.formatters[agent](row, external_prompts=external)


def sequences_per_call(args: Any, num_agents: int) -> int:
    """The most sequences one engine call of a run can hold (per agent): `run_episode_batch`
    rolls out up to rollout_buffer_size prompts at once in a single-turn run and one prompt
    in a multi-turn run, whose last turn has a node per joint action of every node before it
    (K aligned, K^N crossed), each sampled K times; an evaluation, eval_batch_size prompts
    sampled once. Engines size their CPU KV cache from it (`cpu_kv_cache_bytes`)."""
    k = args.num_generations
    prompts = args.rollout_buffer_size if args.num_turns == 1 else 1
    children = len(magrpo.joint_actions(num_agents, k, args.cross))
    return max(prompts * children ** (args.num_turns - 1) * k, args.eval_batch_size)


PROMPT_SCAN_LIMIT = 1024
"""The most prompts (rows x agents) `longest_sequence` formats and tokenizes at start, so the
scan stays a small start-up cost on the driver (BENCHMARKS.md); past that the engines plan for
their longest length."""


def longest_sequence(trainer: Any) -> int | None:
    """The most tokens one sequence of a single-turn run holds in an engine: its longest
    prompt (train and eval rows, every agent, encoded as the rollout does) plus
    max_new_tokens. Engines size their CPU KV cache from it (`cpu_kv_cache_bytes`).
    None where that is not known at start: a multi-turn run (later prompts carry the turns'
    texts), more than PROMPT_SCAN_LIMIT prompts, or a user's formatter, which is called
    where comlrl 1.4.3 calls it, once per row and rollout, and never ahead of it."""
    args, n = trainer.args, trainer.num_agents
    rows = (trainer.train_rows or []) + (trainer.eval_rows or [])
    if args.num_turns != 1 or not rows or len(rows) * n > PROMPT_SCAN_LIMIT or \
            any(getattr(f, "user", None) is not None for f in trainer.formatters):
        return None
    prompt = max(len(_encode(trainer.tokenizers[a], format_prompt(trainer, a, row, None)))
                 for row in rows for a in range(n))
    return prompt + args.max_new_tokens


def run_episode_batch(trainer: Any, session: Any, epoch: int, row_indices: list[int],
                      record: StepRecord, *, seed_tag: Any = "train",
                      num_generations: int | None = None, rows: list[dict] | None = None,
                      evaluation: bool = False) -> list[Episode]:
    """Roll out the prompts `row_indices` of the dataset: trees, rewards, returns, env_steps.

    `evaluation=True` follows one path to the last turn (no early termination) and leaves
    env_step alone: evaluation never counts.
    """
    args = trainer.args
    n_agents = trainer.num_agents
    k = num_generations or args.num_generations
    rows = rows if rows is not None else trainer.train_rows
    episodes = []
    for i in row_indices:
        row = rows[i]
        prompts = [format_prompt(trainer, a, row, None) for a in range(n_agents)]
        root = Node(0, (), prompts, [[p] for p in prompts], [[] for _ in range(n_agents)])
        episodes.append(Episode(i, row, root))

    frontier = [(ep, ep.root) for ep in episodes]
    for turn in range(args.num_turns):
        if not frontier:
            break
        requests: list[list[dict]] = [[] for _ in range(n_agents)]
        for ep, node in frontier:
            for a in range(n_agents):
                node.prompt_ids.append(_encode(trainer.tokenizers[a], node.prompts[a]))
                seed = magrpo.derive_seed(args.seed, seed_tag, epoch, ep.row_index, node.path, a)
                requests[a].append({"prompt_ids": node.prompt_ids[a], "n": k, "seed": seed})
        outputs = session.generate(requests, record)
        next_frontier = []
        for f_i, (ep, node) in enumerate(frontier):
            for a in range(n_agents):
                tok = trainer.tokenizers[a]
                eos = {tok.eos_token_id}
                ids = [magrpo.trim_at_eos(s["token_ids"], eos) for s in outputs[a][f_i]]
                node.token_ids.append(ids)
                node.texts.append([tok.decode(t, skip_special_tokens=True) for t in ids])
            node.combos = magrpo.joint_actions(n_agents, k, args.cross)
            per_agent = [[node.texts[a][c[a]] for c in node.combos] for a in range(n_agents)]
            n = len(node.combos)
            # comlrl calls the reward once per joint action, with prompts=[p], batch_items=[row]
            # and one completion per agent; the batched call gets the same lists, aligned: p and
            # row repeated once per joint action. p is agent 0's prompt this turn (evaluation:
            # its first-turn prompt, as comlrl's evaluate passes at every turn).
            reward_prompt = ep.root.prompts[0] if evaluation else node.prompts[0]
            node.rewards = rewards.call_reward(
                trainer.reward_func, per_agent, prompts=[reward_prompt] * n,
                batch_items=[ep.row] * n, style=trainer.reward_style,
                reward_processor=trainer.reward_processor)
            assert len(node.rewards) == n
            threshold = args.early_termination_threshold
            mean = sum(node.rewards) / n
            expand = evaluation or threshold is None or mean <= threshold
            if turn + 1 < args.num_turns and expand:
                next_frontier.extend((ep, child) for child in _expand(trainer, ep, node))
        frontier = next_frontier

    for ep in episodes:
        _compute_returns(ep.root, args.discount)
        if not evaluation:
            ep.env_step_before = trainer.env_step
            for node in ep.nodes:
                trainer.env_step += len(node.rewards)
                node.env_step = trainer.env_step
    return episodes


def _expand(trainer: Any, ep: Episode, node: Node) -> list[Node]:
    """One child per joint action, with the prompts `external_transition` returns."""
    n_agents = trainer.num_agents
    children = []
    for j, combo in enumerate(node.combos):
        chosen = [node.texts[a][combo[a]] for a in range(n_agents)]
        responses = [node.response_history[a] + [chosen[a]] for a in range(n_agents)]
        nxt = trainer.external_transition(
            prompt=ep.row.get("prompt", ""), agent_completions=chosen, num_agents=n_agents,
            prompt_history_per_agent=[list(h) for h in node.prompt_history],
            response_history_per_agent=[list(r) for r in responses])
        if not isinstance(nxt, (list, tuple)) or len(nxt) != n_agents:
            raise ValueError(f"External transition must return per-agent prompts: a list of "
                             f"{n_agents} strings, got {nxt!r}.")
        prompts = [format_prompt(trainer, a, ep.row, nxt[a]) for a in range(n_agents)]
        child = Node(node.turn + 1, node.path + (j,), prompts,
                     [node.prompt_history[a] + [prompts[a]] for a in range(n_agents)], responses)
        node.children[j] = child
        children.append(child)
    return children


def _compute_returns(node: Node, discount: float) -> list[float]:
    """Return of joint action j = its reward + discount * mean return of its child."""
    node.returns = []
    for j, r in enumerate(node.rewards):
        child = node.children.get(j)
        if child is None:
            node.returns.append(float(r))
        else:
            child_returns = _compute_returns(child, discount)
            node.returns.append(float(r) + discount * sum(child_returns) / len(child_returns))
    return node.returns


def _encode(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if not ids:
        raise ValueError(f"prompt {text!r} encodes to no tokens; every prompt needs some text.")
    return list(ids)
