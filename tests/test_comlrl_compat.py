"""comlrl 1.4.3 compatibility: config placement fields, RewardProcessors, reward-call forms.

Every expectation here was first observed by running the same call in comlrl 1.4.3 (its own
virtualenv, benchmarks/.venv-comlrl); each docstring says what comlrl gave. No vLLM, no Ray.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from comlrl import rewards
from comlrl.config import RESUMABLE_FIELDS, MAGRPOConfig
from comlrl.rollout import StepRecord, run_episode_batch
from tests.test_rollout_tree import FakeSession, FakeTokenizer

# ---------------------------------------------------------------- comlrl's module paths


@pytest.mark.parametrize("module, config, trainer, mode, algorithm, turns", [
    ("magrpo", "MAGRPOConfig", "MAGRPOTrainer", "mean", "MAGRPO", 2),
    ("centralized_magrpo", "CentralizedMAGRPOConfig", "CentralizedMAGRPOTrainer", "mean",
     "MAGRPO", 1),
    ("mareinforce", "MAREINFORCEConfig", "MAREINFORCETrainer", "raw", "MAREINFORCE", 2),
    ("marloo", "MARLOOConfig", "MARLOOTrainer", "rloo", "MARLOO", 2),
    ("maremax", "MAReMaxConfig", "MAReMaxTrainer", "max", "MAReMax", 2),
])
def test_trainers_import_from_comlrls_module_paths(module, config, trainer, mode, algorithm,
                                                   turns):
    """comlrl 1.4.3, each `from comlrl.trainers.reinforce.<module> import <Config>, <Trainer>`:
    the config's advantage_mode and num_turns defaults and the trainer's algorithm_name and
    default_config_cls are these (the package re-exports the same classes)."""
    import importlib

    import comlrl.trainers.reinforce as package

    found = importlib.import_module(f"comlrl.trainers.reinforce.{module}")
    config_cls, trainer_cls = getattr(found, config), getattr(found, trainer)
    assert (config_cls().advantage_mode, config_cls().num_turns) == (mode, turns)
    assert (trainer_cls.algorithm_name, trainer_cls.default_config_cls) == (algorithm,
                                                                            config_cls)
    assert getattr(package, trainer) is trainer_cls and getattr(package, config) is config_cls


# ---------------------------------------------------------------- config: comlrl's fields


def test_placement_fields_exist_with_comlrls_defaults():
    """comlrl: MAGRPOConfig() has parallel_training='none', agent_devices=None,
    reference_devices=None; MAGRPOConfig(agent_devices='cpu') is accepted."""
    c = MAGRPOConfig()
    assert (c.parallel_training, c.agent_devices, c.reference_devices) == ("none", None, None)
    assert MAGRPOConfig(agent_devices="cpu").agent_devices == "cpu"
    assert c.weight_bucket_bytes == 256 * 1024 * 1024
    assert c.skip_callable_fingerprints is False


@pytest.mark.parametrize("value,expected", [
    ("none", "none"), ("null", "none"), (None, "none"), ("", "none"), (False, "none"),
    (" MP ", "mp"),
])
def test_parallel_training_is_normalised_like_comlrl(value, expected):
    """comlrl: 'null', None, '' and False become 'none'; ' MP ' (with agent_devices) becomes
    'mp'."""
    kwargs = {"agent_devices": "cpu"} if expected == "mp" else {}
    assert MAGRPOConfig(parallel_training=value, **kwargs).parallel_training == expected


@pytest.mark.parametrize("kwargs,match", [
    ({"parallel_training": "ddp"}, r"parallel_training only supports: none, mp\."),
    ({"parallel_training": True}, r"parallel_training only supports: none, mp\."),
    ({"parallel_training": "mp"}, r"parallel_training='mp' requires explicit agent_devices\."),
    ({"agent_devices": []}, r"agent_devices must be a non-empty list or 'auto'\."),
    ({"agent_devices": 5}, r"Unsupported agent_devices spec: 5\."),
    ({"reference_kl_enabled": True, "reference_devices": []},
     r"reference_devices must be a non-empty list or 'auto'\."),
    ({"reference_kl_enabled": True, "reference_devices": 5},
     r"Unsupported reference_devices spec: 5\."),
    ({"reference_kl_enabled": True, "reference_devices": ["cpu"] * 3, "agent_devices": "cpu"},
     r"reference_devices length \(3\) must be 1 or 2\."),
])
def test_placement_errors_keep_comlrls_words(kwargs, match):
    """comlrl raised ValueError with exactly these words for the same arguments (the
    agent_devices ones at trainer construction, from DeviceScheduler; here at config time)."""
    with pytest.raises(ValueError, match=match):
        MAGRPOConfig(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"agent_devices": "bogus"}, "agent_devices: 'bogus' is not a device"),
    ({"agent_devices": "mps"}, "agent_devices: 'mps' is a torch device"),
    ({"reference_kl_enabled": True, "reference_devices": "bogus"},
     "reference_devices: 'bogus' is not a device"),
    ({"agent_devices": ["cpu", "auto"], "parallel_training": "mp"},
     "agent_devices: 'auto' is accepted as the whole spec"),
])
def test_devices_comlrl_refuses_in_torch_are_value_errors_naming_the_field(kwargs, match):
    """comlrl: torch.device('bogus') / torch.device('auto') inside a list raise RuntimeError
    ('Expected one of cpu, cuda, ... device type at start of device string'); 'mps' is accepted
    by comlrl but no learner here runs on it. Here all are ValueErrors naming the field."""
    with pytest.raises(ValueError, match=match):
        MAGRPOConfig(**kwargs)


def test_agent_devices_map_onto_learner_device_per_agent():
    """comlrl: with parallel_training='none' every agent gets the first entry
    (DeviceScheduler.resolve_single_device: ['cpu', 'cuda:1'] -> cpu for all); with 'mp' entry i
    is agent i's, and a list must have 1 or num_agents entries ('agent_devices length (3) must
    be 1 or 2.'); None/'auto' let the auto rule decide (here: learner_device)."""
    assert [MAGRPOConfig().learner_device_for(i) for i in range(2)] == ["auto", "auto"]
    assert MAGRPOConfig(learner_device="cpu").learner_device_for(1) == "cpu"
    assert [MAGRPOConfig(agent_devices="cpu").learner_device_for(i) for i in range(2)] == \
        ["cpu", "cpu"]
    mixed = ["cpu", "cuda:1"]
    assert [MAGRPOConfig(agent_devices=mixed).learner_device_for(i) for i in range(2)] == \
        ["cpu", "cpu"]
    mp = MAGRPOConfig(agent_devices=mixed, parallel_training="mp")
    assert [mp.learner_device_for(i) for i in range(2)] == ["cpu", "cuda"]
    assert mp.agent_device_specs() == ["cpu", "cuda:1"]
    three = MAGRPOConfig(agent_devices=["cpu", "cpu", "cuda"], parallel_training="mp")
    assert three.learner_device_for(2, num_agents=3) == "cuda"      # the trainer's real count
    with pytest.raises(ValueError, match=r"agent_devices length \(3\) must be 1 or 2\."):
        three.learner_device_for(0)
    with pytest.raises(ValueError, match="contradicts learner_device='cpu'"):
        MAGRPOConfig(agent_devices="cuda", learner_device="cpu")


def test_reference_devices_must_be_the_agents_device():
    """comlrl accepts any resolvable reference_devices (e.g. 'cpu' next to agents on cuda:0,
    or 'cuda:1' for agents on cuda:0) and checks them only with reference_kl_enabled
    (MAGRPOConfig(reference_devices='bogus') is accepted). Here the reference copy lives in its
    agent's learner: a device other than the agent's is a ValueError naming the field."""
    assert MAGRPOConfig(reference_devices="bogus").reference_devices == "bogus"   # KL off
    ok = MAGRPOConfig(reference_kl_enabled=True, agent_devices="cpu", reference_devices="cpu")
    ok.check_devices()
    MAGRPOConfig(reference_kl_enabled=True, learner_device="cpu", reference_devices=["cpu"])
    MAGRPOConfig(reference_kl_enabled=True, agent_devices="cpu", reference_devices="auto")
    MAGRPOConfig(reference_kl_enabled=True, agent_devices=["cuda:0", "cuda:1"],
                 parallel_training="mp", reference_devices=["cuda:0", "cuda:1"])
    for kwargs in ({"reference_devices": "cpu"},                        # agent device: auto
                   {"agent_devices": "cuda", "reference_devices": "cpu"},
                   {"agent_devices": "cuda:0", "reference_devices": "cuda:1"}):
        with pytest.raises(ValueError, match=r"reference_devices\[0\] = .* cannot be honoured"):
            MAGRPOConfig(reference_kl_enabled=True, **kwargs)


def test_new_fields_are_validated_and_resumable():
    """weight_bucket_bytes >= 1 MiB; skip_callable_fingerprints a bool. Placement fields change
    where things run, never what is computed: all five may change on resume."""
    with pytest.raises(ValueError, match="weight_bucket_bytes must be an int of at least 1 MiB"):
        MAGRPOConfig(weight_bucket_bytes=1000)
    assert MAGRPOConfig(weight_bucket_bytes=1 << 20).weight_bucket_bytes == 1 << 20
    with pytest.raises(ValueError, match="skip_callable_fingerprints must be True or False"):
        MAGRPOConfig(skip_callable_fingerprints="yes")
    assert {"agent_devices", "parallel_training", "reference_devices", "weight_bucket_bytes",
            "skip_callable_fingerprints"} <= RESUMABLE_FIELDS


def test_joint_mode_is_free_with_one_agent():
    """comlrl: MAGRPOConfig(joint_mode='diagonal') is accepted at config time (any num_agents);
    training with one agent and joint_mode='diagonal' (or 'cross') runs aligned; with two
    agents train() raises 'Unsupported joint_mode: diagonal' at the first rollout node. Here:
    accepted by the config, refused by the trainer with more than one agent (check_joint_mode,
    at construction; tests/test_comlrl_compat_train.py)."""
    assert MAGRPOConfig(num_agents=1, joint_mode="diagonal").cross is False
    assert MAGRPOConfig(num_agents=1, joint_mode="cross").joint_mode == "cross"
    assert MAGRPOConfig(joint_mode="diagonal").joint_mode == "diagonal"
    single = MAGRPOConfig(num_agents=1, joint_mode="diagonal")
    single.check_joint_mode(1)
    with pytest.raises(ValueError, match="Unsupported joint_mode"):
        single.check_joint_mode(2)


# ---------------------------------------------------------------- RewardProcessors


def test_reward_processors_match_comlrl():
    """comlrl: RewardProcessors.scale(2.0)(3) == 6.0, shift(1.5)(1) == 2.5, scale()(4.0) ==
    4.0, shift()(4.0) == 4.0 (defaults 1.0 / 0.0); both are static methods returning a
    one-argument callable."""
    from comlrl.utils import RewardProcessors as FromPackage
    from comlrl.utils.reward_processor import RewardProcessors

    assert FromPackage is RewardProcessors
    assert RewardProcessors.scale(2.0)(3) == 6.0
    assert RewardProcessors.shift(1.5)(1) == 2.5
    assert RewardProcessors.scale()(4.0) == 4.0 and RewardProcessors.shift()(4.0) == 4.0
    assert RewardProcessors().scale(-1)(2) == -2
    out = rewards.call_reward(lambda a, b: [1.0, 2.0], [["x", "y"], ["u", "v"]],
                              prompts=["p"] * 2, batch_items=[{}] * 2,
                              style={"prompts": False, "batch_items": False},
                              reward_processor=RewardProcessors.shift(0.5))
    assert out == [1.5, 2.5]


# ---------------------------------------------------------------- reward-call forms

ROW = {"prompt": "row"}
SEEN: list = []


def _recorder(src: str):
    namespace = {"SEEN": SEEN}
    exec(src, namespace)
    return namespace["r"]


# (name, number of agents, reward source, comlrl's recorded call for one joint action with
# prompts=['P'], completions [['A'], ['B']] (or [['A']]) and batch_items=[ROW]).
FORMS = [
    ("lists", 2, "def r(c1, c2):\n SEEN.append(((c1, c2), {})); return [1.0]",
     ((["A"], ["B"]), {})),
    ("lists+prompts+batch_items", 2,
     "def r(c1, c2, prompts=None, batch_items=None):\n"
     " SEEN.append(((c1, c2), {'prompts': prompts, 'batch_items': batch_items})); return [1.0]",
     ((["A"], ["B"]), {"prompts": ["P"], "batch_items": [ROW]})),
    ("lists+kwonly", 2,
     "def r(c1, c2, *, prompts=None, batch_items=None):\n"
     " SEEN.append(((c1, c2), {'prompts': prompts, 'batch_items': batch_items})); return [1.0]",
     ((["A"], ["B"]), {"prompts": ["P"], "batch_items": [ROW]})),
    # comlrl counts 3 positional parameters = N + 1: prompts go first, positionally.
    ("lists+prompts=None (comlrl shifts)", 2,
     "def r(c1, c2, prompts=None):\n"
     " SEEN.append(((c1, c2), {'prompts': prompts})); return [1.0]",
     ((["P"], ["A"]), {"prompts": ["B"]})),
    # comlrl's first call (prompts, A, B, batch_items=) cannot bind: it retries with the lists.
    ("lists+batch_items=None", 2,
     "def r(c1, c2, batch_items=None):\n"
     " SEEN.append(((c1, c2), {'batch_items': batch_items})); return [1.0]",
     ((["A"], ["B"]), {"batch_items": None})),
    ("prompts first", 2, "def r(prompts, c1, c2):\n SEEN.append(((prompts, c1, c2), {})); "
     "return [1.0]", ((["P"], ["A"], ["B"]), {})),
    ("prompts first+**kw", 2, "def r(prompts, c1, c2, **kw):\n"
     " SEEN.append(((prompts, c1, c2), kw)); return [1.0]",
     ((["P"], ["A"], ["B"]), {"batch_items": [ROW]})),
    ("three positionals", 2, "def r(a, b, c):\n SEEN.append(((a, b, c), {})); return [1.0]",
     ((["P"], ["A"], ["B"]), {})),
    ("one argument", 2, "def r(completions):\n SEEN.append(((completions,), {})); "
     "return [1.0]", (([["A"], ["B"]],), {})),
    ("one argument+**kw", 2, "def r(completions, **kw):\n"
     " SEEN.append(((completions,), kw)); return [1.0]",
     (([["A"], ["B"]],), {"batch_items": [ROW], "prompts": ["P"]})),
    ("*args", 2, "def r(*cs):\n SEEN.append((cs, {})); return [1.0]", ((["A"], ["B"]), {})),
    ("*args+**kw", 2, "def r(*cs, **kw):\n SEEN.append((cs, kw)); return [1.0]",
     ((["A"], ["B"]), {"batch_items": [ROW], "prompts": ["P"]})),
    ("lists+**kw", 2, "def r(c1, c2, **kw):\n SEEN.append(((c1, c2), kw)); return [1.0]",
     ((["A"], ["B"]), {"batch_items": [ROW], "prompts": ["P"]})),
    ("lists+3 defaults", 2, "def r(c1, c2, x=None, y=None, z=None):\n"
     " SEEN.append(((c1, c2, x, y, z), {})); return [1.0]",
     ((["A"], ["B"], None, None, None), {})),
    ("1 agent: one list", 1, "def r(c):\n SEEN.append(((c,), {})); return [1.0]",
     ((["A"],), {})),
    ("1 agent: two positionals", 1, "def r(a, b):\n SEEN.append(((a, b), {})); return [1.0]",
     ((["P"], ["A"]), {})),
    ("1 agent: list+batch_items=None", 1,
     "def r(c, batch_items=None):\n SEEN.append(((c,), {'batch_items': batch_items})); "
     "return [1.0]", ((["A"],), {"batch_items": None})),
    ("1 agent: one list+**kw", 1, "def r(c, **kw):\n SEEN.append(((c,), kw)); return [1.0]",
     ((["A"],), {"batch_items": [ROW], "prompts": ["P"]})),
    ("1 agent: *args+**kw", 1, "def r(*cs, **kw):\n SEEN.append((cs, kw)); return [1.0]",
     ((["A"],), {"batch_items": [ROW], "prompts": ["P"]})),
]


def _expand(value, n: int):
    """comlrl's one-joint-action argument, batched over n joint actions: every one-element
    list becomes its element repeated n times (the lists stay aligned)."""
    if isinstance(value, list) and len(value) == 1 and not isinstance(value[0], list):
        return value * n
    if isinstance(value, list):
        return [_expand(v, n) for v in value]
    return value


@pytest.mark.parametrize("name,n_agents,src,comlrl_call", FORMS, ids=[f[0] for f in FORMS])
def test_each_reward_form_gets_comlrls_arguments(name, n_agents, src, comlrl_call):
    """The expected call of each case is what comlrl 1.4.3's call_reward_function passed a
    recording reward (benchmarks/.venv-comlrl; prompts=['P'], batch_items=[ROW]). One joint
    action: the same call exactly. Three joint actions (one batched call): the same shapes,
    each one-element list repeated per joint action."""
    reward = _recorder(src)
    style = rewards.reward_call_style(reward, n_agents)
    lists = [["A"], ["B"]][:n_agents]
    SEEN.clear()
    assert rewards.call_reward(reward, lists, prompts=["P"], batch_items=[ROW],
                               style=style) == [1.0]
    assert len(SEEN) == 1
    args, kwargs = SEEN[0]
    assert (list(args), kwargs) == (list(comlrl_call[0]), comlrl_call[1])

    batched = _recorder(src.replace("return [1.0]", "return [1.0, 2.0, 3.0]"))
    SEEN.clear()
    out = rewards.call_reward(batched, [["A"] * 3, ["B"] * 3][:n_agents], prompts=["P"] * 3,
                              batch_items=[ROW] * 3,
                              style=rewards.reward_call_style(batched, n_agents))
    assert out == [1.0, 2.0, 3.0]
    args, kwargs = SEEN[0]
    assert list(args) == _expand(list(comlrl_call[0]), 3)
    assert kwargs == {k: _expand(v, 3) for k, v in comlrl_call[1].items()}


class _NoSignature:
    """A callable inspect.signature cannot read (comlrl then tries (*lists, batch_items=...),
    then (*lists), then (lists))."""

    __signature__ = "not a signature"

    def __init__(self, accepts):
        self.accepts, self.calls = accepts, []

    def __call__(self, *args, **kwargs):
        if not self.accepts(args, kwargs):
            raise TypeError("does not bind")
        self.calls.append((args, kwargs))
        return [1.0]


@pytest.mark.parametrize("accepts,expected", [
    (lambda a, k: True, ((["A"], ["B"]), {"batch_items": [ROW]})),
    (lambda a, k: len(a) == 2 and not k, ((["A"], ["B"]), {})),
    (lambda a, k: len(a) == 1 and not k, (([["A"], ["B"]],), {})),
])
def test_reward_without_signature_is_called_like_comlrl(accepts, expected):
    """comlrl with a signature-less callable (call_reward_function, signature None): accepting
    anything -> called (['A'], ['B'], batch_items=[ROW]); taking (c1, c2) only -> (['A'],
    ['B']); taking one argument -> ([['A'], ['B']],). The form found first is kept."""
    reward = _NoSignature(accepts)
    style = rewards.reward_call_style(reward, 2)
    assert style["positional"] == "probe"
    for _ in range(2):
        assert rewards.call_reward(reward, [["A"], ["B"]], prompts=["P"], batch_items=[ROW],
                                   style=style) == [1.0]
    assert reward.calls == [expected, expected]
    assert style.get("positional") != "probe"


@pytest.mark.parametrize("n_agents,src", [
    (1, "def r(prompts, c1, c2):\n return [0.0]"),
    (2, "def r(c1, c2, *, extra):\n return [0.0]"),
    (2, "def r():\n return [0.0]"),
])
def test_reward_comlrl_cannot_call_is_refused_at_construction(n_agents, src):
    """comlrl raised TypeError at every call for these ("r() missing 1 required positional
    argument: 'c2'", "r() missing 1 required keyword-only argument: 'extra'"); here the
    signature is refused when the trainer is built."""
    with pytest.raises(ValueError, match="binds none of them"):
        rewards.reward_call_style(_recorder(src), n_agents)


def test_a_bare_number_is_the_reward_of_a_single_joint_action():
    """comlrl coerces a non-list result to [float(result)] (one joint action per call); a
    batched call over several joint actions still needs a list."""
    style = rewards.reward_call_style(lambda a, b: 0.25, 2)
    assert rewards.call_reward(lambda a, b: 0.25, [["x"], ["y"]], prompts=["p"],
                               batch_items=[{}], style=style) == [0.25]
    with pytest.raises(ValueError, match="must return a list of 2 floats"):
        rewards.call_reward(lambda a, b: 0.25, [["x", "z"], ["y", "w"]], prompts=["p"] * 2,
                            batch_items=[{}] * 2, style=style)


# ---------------------------------------------------------------- the rollout's reward call


@pytest.mark.parametrize("joint_mode,n_joint", [("aligned", 3), ("cross", 9)])
def test_rollout_passes_prompts_and_rows_aligned_with_the_joint_actions(joint_mode, n_joint):
    """comlrl (MAGRPOTrainer.train, recording reward(c1, c2, prompts=None, batch_items=None),
    K=2, formatter 'F:'+prompt): aligned -> K calls, each c1/c2 of length 1, prompts=['F:hello']
    (agent 0's formatted prompt), batch_items=[the dataset row]. Here one call per node with
    every list of length K (or K^N): prompts and batch_items repeated per joint action. (comlrl's
    cross mode passes no prompts at all; here cross gets them like aligned.)"""
    calls = []

    def reward(c1, c2, prompts=None, batch_items=None):
        calls.append((list(c1), list(c2), prompts, batch_items))
        return [0.0] * len(c1)

    row = {"prompt": "hello", "extra": 7}
    tok = FakeTokenizer()
    trainer = SimpleNamespace(
        args=MAGRPOConfig(num_generations=3, num_turns=1, joint_mode=joint_mode),
        num_agents=2, tokenizers=[tok, tok], env_step=0,
        formatters=[lambda r, external_prompts=None: "F:" + r["prompt"]] * 2,
        reward_func=reward, reward_style=rewards.reward_call_style(reward, 2),
        reward_processor=None, external_transition=None, train_rows=[row])
    run_episode_batch(trainer, FakeSession(), 0, [0], StepRecord())
    assert len(calls) == 1
    c1, c2, prompts, batch_items = calls[0]
    assert len(c1) == len(c2) == n_joint
    assert prompts == ["F:hello"] * n_joint
    assert batch_items == [row] * n_joint


def test_prompts_first_reward_trains_through_the_rollout():
    """comlrl: reward(prompts, c1, c2) gets (['F:hello'], [c1_j], [c2_j]) per joint action; it
    was accepted at construction here before and failed at every call."""
    seen = []

    def reward(prompts, c1, c2):
        seen.append((prompts, c1, c2))
        return [float(len(a)) for a in c1]

    tok = FakeTokenizer()
    trainer = SimpleNamespace(
        args=MAGRPOConfig(num_generations=2, num_turns=1), num_agents=2,
        tokenizers=[tok, tok], env_step=0,
        formatters=[lambda r, external_prompts=None: "F:" + r["prompt"]] * 2,
        reward_func=reward, reward_style=rewards.reward_call_style(reward, 2),
        reward_processor=None, external_transition=None, train_rows=[{"prompt": "hello"}])
    (episode,) = run_episode_batch(trainer, FakeSession(), 0, [0], StepRecord())
    assert seen == [(["F:hello", "F:hello"], ["a", "aa"], ["b", "bb"])]
    assert episode.root.rewards == [1.0, 2.0]


_COMLRL_PYTHON = (__import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks" /
                  ".venv-comlrl" / "bin" / "python")

_REPLAY = """
import json, sys
from comlrl.utils.reward_utils import call_reward_function
ROW = {"prompt": "row"}
out = []
for n_agents, src in json.load(sys.stdin):
    SEEN = []
    ns = {"SEEN": SEEN}
    exec(src, ns)
    call_reward_function(ns["r"], ["P"], [["A"], ["B"]][:n_agents], num_agents=n_agents,
                         batch_items=[ROW])
    out.append([[list(a), k] for a, k in SEEN])
print(json.dumps(out))
"""


@pytest.mark.skipif(not _COMLRL_PYTHON.exists(),
                    reason="comlrl 1.4.3 reference venv (benchmarks/.venv-comlrl) not built")
def test_recorded_forms_are_what_comlrl_passes_now():
    """Replays FORMS through comlrl 1.4.3's own call_reward_function (reference venv) and
    checks the recorded comlrl calls above are still exactly what it passes."""
    import json
    import subprocess
    import tempfile

    payload = json.dumps([[n, src] for _, n, src, _ in FORMS])
    out = subprocess.run([str(_COMLRL_PYTHON), "-c", _REPLAY], input=payload,
                         capture_output=True, text=True, timeout=300, check=True,
                         cwd=tempfile.gettempdir())     # not this checkout's comlrl
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for (name, _, _, (args, kwargs)), calls in zip(FORMS, got):
        assert calls == [[json.loads(json.dumps(list(args))), kwargs]], name
