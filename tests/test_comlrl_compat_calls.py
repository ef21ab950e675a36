"""comlrl 1.4.3 calls (issue 38): `train(**kwargs)`, `save_checkpoint(...)`,
`reference_models`, and a model whose heads are smaller than vLLM's CPU attention takes.

Each docstring says what comlrl 1.4.3 gave for the same call, run in its own virtualenv
(benchmarks/.venv-comlrl) with the tiny model of tests/conftest.py, two prompts, one epoch,
num_generations=2, max_new_tokens=4, agent_devices="cpu", W&B disabled.
"""

from __future__ import annotations

import inspect
import warnings

import pytest

from tests.test_comlrl_compat_train import _config, _data, reward


def _trainer(tiny_model, **kw):
    from comlrl.trainers.reinforce import MAGRPOTrainer

    return MAGRPOTrainer(agents=[tiny_model, tiny_model], reward_func=reward,
                         train_dataset=_data(), args=_config(eval_interval=0, **kw))


def _weights(trainer):
    return [p.detach().clone() for agent in trainer._initial_models() for p in agent.parameters()]


def _same(a, b) -> bool:
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------ train(**kwargs)


def test_train_takes_keyword_arguments_like_comlrl():
    """comlrl 1.4.3: `MAGRPOTrainer.train(self, resume_from_checkpoint=None,
    checkpoint_dir=None, checkpoint_interval=1, checkpoint_total_limit=None, **kwargs)`."""
    from comlrl.trainers.reinforce import MAGRPOTrainer, MARLOOTrainer

    for cls in (MAGRPOTrainer, MARLOOTrainer):
        params = inspect.signature(cls.train).parameters
        assert list(params)[1:5] == ["resume_from_checkpoint", "checkpoint_dir",
                                     "checkpoint_interval", "checkpoint_total_limit"]
        assert params["kwargs"].kind is inspect.Parameter.VAR_KEYWORD


def test_generation_keywords_comlrl_fails_on_fail_here_before_anything_starts(tiny_model):
    """comlrl 1.4.3 hands train()'s keywords to HF `generate` for every training rollout:
    `train(foo=1)` raised ValueError "Generation failed: The following `model_kwargs` are
    not used by the model: ['foo'] (note: typos ...)", and `train(max_new_tokens=3)` raised
    TypeError "... got multiple values for keyword argument 'max_new_tokens'" (both at the
    first rollout; here before Ray or any engine starts)."""
    trainer = _trainer(tiny_model)
    with pytest.raises(ValueError, match=r"The following `model_kwargs` are not used by the "
                                         r"model: \['foo'\]"):
        trainer.train(foo=1)
    with pytest.raises(TypeError, match="got multiple values for keyword argument "
                                        "'max_new_tokens'"):
        trainer.train(max_new_tokens=3)
    assert trainer._session is None and trainer.env_step == 0


def test_generation_keywords_that_would_sample_differently_are_refused(tiny_model):
    """comlrl 1.4.3 trained with `train(temperature=1.0)` and `train(repetition_penalty=1.2)`
    (env_step 4), sampling its training rollouts with them. The engines here sample as the
    config says, so a keyword that would change that is refused, naming the config field."""
    trainer = _trainer(tiny_model)
    with pytest.raises(ValueError, match=r"MAGRPOConfig\(temperature="):
        trainer.train(temperature=1.0)
    with pytest.raises(ValueError, match="repetition_penalty=1.2"):
        trainer.train(repetition_penalty=1.2)


@pytest.mark.e2e
def test_keywords_that_change_nothing_train_and_reference_models_stay_initial(
        ray_session, tiny_model):
    """comlrl 1.4.3: `train()` and `train(do_sample=False)` trained (env_step 4; it drops
    `do_sample`). A subclass passing its options through with the config's own sampling
    values changes nothing either. With `reference_kl_enabled` and model objects,
    `trainer.reference_models` kept the initial weights after `train()` while the agents
    changed (comlrl copies them at construction)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from comlrl.trainers.reinforce import MAGRPOTrainer

    class PassThrough(MAGRPOTrainer):
        def train(self, *args, **kwargs):
            return super().train(*args, **kwargs)

    models = [AutoModelForCausalLM.from_pretrained(tiny_model) for _ in range(2)]
    trainer = PassThrough(agents=models, tokenizer=AutoTokenizer.from_pretrained(tiny_model),
                          reward_func=reward, train_dataset=_data(),
                          args=_config(eval_interval=0, reference_kl_enabled=True))
    before = _weights(trainer)
    args = trainer.args
    trainer.train(do_sample=False, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, num_beams=1)
    assert trainer.env_step == 4
    assert not _same(before, _weights(trainer))
    refs = trainer.reference_models
    assert _same(before, [p for r in refs for p in r.parameters()])
    assert all(not r.training and not any(p.requires_grad for p in r.parameters())
               for r in refs)


# ------------------------------------------------------------------ reference_models


def test_reference_models_like_comlrl(tiny_model):
    """comlrl 1.4.3: `trainer.reference_models` is `[]` without `reference_kl_enabled`; with
    it, one frozen copy per agent (a Qwen2ForCausalLM, not the agent itself, every
    `requires_grad` False, `training` False). Two agents given as the same model object got
    two distinct copies."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from comlrl.trainers.reinforce import MAGRPOTrainer

    assert _trainer(tiny_model).reference_models == []
    named = _trainer(tiny_model, reference_kl_enabled=True)
    refs = named.reference_models
    assert [type(r).__name__ for r in refs] == ["Qwen2ForCausalLM"] * 2
    assert named.reference_models is refs          # built once
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    shared = MAGRPOTrainer(agents=[model, model],
                           tokenizer=AutoTokenizer.from_pretrained(tiny_model),
                           reward_func=reward, train_dataset=_data(),
                           args=_config(reference_kl_enabled=True))
    copies = shared.reference_models
    assert copies[0] is not model and copies[1] is not model and copies[0] is not copies[1]
    for r in refs + copies:
        assert not r.training and not any(p.requires_grad for p in r.parameters())
    assert _same([p for p in model.parameters()], [p for p in copies[0].parameters()])


# ------------------------------------------------------------------ head_dim < 32


def _head_dim_8_model(folder, tiny_model) -> str:
    """A Qwen2 model with head_dim 8 (hidden 32, 4 heads), built directly: the tiny-model
    builder refuses head_dim < 32."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                         max_position_embeddings=128, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_head_dim_below_vllm_cpu_minimum_falls_back_to_hf_once(tiny_model, tmp_path):
    """comlrl 1.4.3 trained a head_dim-8 model (HF generate; env_step 4). vLLM's CPU attention
    refuses it ("Unsupported CPU attention configuration: head_dim=8"), so its rollouts here
    go to the HF engine, said once at construction; a model vLLM takes, or engines on a GPU,
    keep vLLM."""
    small = _head_dim_8_model(tmp_path / "hd8", tiny_model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _trainer(small)
    said = [str(w.message) for w in caught if "head_dim" in str(w.message)]
    assert len(said) == 1 and "head_dim=8" in said[0] and "rollout_engine='hf'" in said[0]
    assert trainer.args.rollout_engine == "hf"
    assert _trainer(tiny_model).args.rollout_engine == "vllm"
    assert _trainer(small, rollout_num_gpus=1.0).args.rollout_engine == "vllm"


@pytest.mark.e2e
def test_head_dim_8_model_trains(ray_session, tiny_model, tmp_path):
    """comlrl 1.4.3 trained the head_dim-8 model one epoch: env_step 4."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _trainer(_head_dim_8_model(tmp_path / "hd8", tiny_model))
    before = _weights(trainer)
    trainer.train()
    assert trainer.env_step == 4 and not _same(before, _weights(trainer))


# ------------------------------------------------------------------ save_checkpoint


def test_save_checkpoint_refuses_a_folder_that_is_not_a_checkpoint(tiny_model, tmp_path):
    """comlrl 1.4.3: FileExistsError "Refusing to replace a non-checkpoint directory: ..."
    for an existing folder that is not a checkpoint (before any train(), too)."""
    target = tmp_path / "notckpt"
    target.mkdir()
    (target / "x").write_text("x")
    with pytest.raises(FileExistsError, match="Refusing to replace a non-checkpoint"):
        _trainer(tiny_model).save_checkpoint(str(target))
    assert (target / "x").read_text() == "x"


@pytest.mark.e2e
def test_save_checkpoint_before_and_after_train_resume_exactly(ray_session, tiny_model,
                                                               tmp_path):
    """comlrl 1.4.3: `save_checkpoint(path)` before any train() and after a plain train()
    returned the absolute path; saving again over that checkpoint replaced it; a resume from
    the after-train one with num_train_epochs=2 reached env_step 8, from the before-train one
    env_step 4 (comlrl's resumed weights differed from a straight run's: its sampling is not
    seeded). Here the resumed runs end with the straight runs' weights, bit for bit; after a
    train(checkpoint_dir=...) the save is that run's last checkpoint. After a plain train()
    the state is written by the learners that train() parked, which only a train() that
    started Ray itself parks; on the tests' shared Ray they are stopped and the save is
    refused, naming checkpoint_dir= (a difference, README)."""
    from comlrl.utils import read_checkpoint_metadata

    straight2 = _trainer(tiny_model, num_train_epochs=2)
    straight2.train()

    fresh = _trainer(tiny_model)
    before = tmp_path / "before"
    assert fresh.save_checkpoint(str(before)) == str(before)
    assert fresh.save_checkpoint(str(before)) == str(before)        # replaced
    assert read_checkpoint_metadata(before)["epoch"] == 0

    # A plain train() on a Ray it did not start stops its learners (the fixture's Ray here;
    # a joined cluster): their AdamW state is gone, and the save says so.
    first = _trainer(tiny_model)                 # also the straight run of one epoch
    first.train()
    with pytest.raises(RuntimeError, match="Pass checkpoint_dir= to train"):
        first.save_checkpoint(str(tmp_path / "after"))

    from_start = _trainer(tiny_model)
    from_start.train(resume_from_checkpoint=str(before))
    assert from_start.env_step == 4 and _same(_weights(from_start), _weights(first))

    kept = _trainer(tiny_model)
    kept.train(checkpoint_dir=str(tmp_path / "ckpt"))
    copy = tmp_path / "copy"
    assert kept.save_checkpoint(str(copy)) == str(copy)
    meta = read_checkpoint_metadata(copy)
    assert (meta["epoch"], meta["env_step"]) == (1, 4)
    assert meta["files"] == \
        read_checkpoint_metadata(tmp_path / "ckpt" / "checkpoint-1")["files"]
    again = _trainer(tiny_model, num_train_epochs=2)
    again.train(resume_from_checkpoint=str(copy))
    assert again.env_step == 8 and _same(_weights(again), _weights(straight2))


@pytest.mark.e2e
def test_save_checkpoint_during_and_after_a_failed_train_is_refused(ray_session, tiny_model,
                                                                    tmp_path):
    """comlrl 1.4.3, a save from inside the reward function: RuntimeError "Training did not
    reach a completed checkpoint boundary; resume the last saved checkpoint." in a plain
    train(), "Checkpoint saving is only supported at a completed training boundary." in a
    train(checkpoint_dir=...); after a train() that raised, the first of these."""
    from comlrl.trainers.reinforce import MAGRPOTrainer

    seen: list = []

    def saving_reward(completions1, completions2):
        try:
            trainer.save_checkpoint(str(tmp_path / "during"))
        except RuntimeError as error:
            seen.append(str(error))
        if len(seen) == 2:
            raise KeyError("stop here")
        return reward(completions1, completions2)

    trainer = MAGRPOTrainer(agents=[tiny_model, tiny_model], reward_func=saving_reward,
                            train_dataset=_data(), args=_config(eval_interval=0,
                                                                rollout_buffer_size=1))
    with pytest.raises(ValueError, match="reward_func raised KeyError: 'stop here'"):
        trainer.train(checkpoint_dir=str(tmp_path / "ckpt"))
    assert seen[0] == "Checkpoint saving is only supported at a completed training boundary."
    with pytest.raises(RuntimeError, match="Training did not reach a completed checkpoint "
                                           "boundary; resume the last saved checkpoint."):
        trainer.save_checkpoint(str(tmp_path / "failed"))
    assert not (tmp_path / "during").exists() and not (tmp_path / "failed").exists()
