"""Models given by name load once, one load at a time (comlrl.loading).

transformers' `from_pretrained` swaps `PreTrainedModel.tie_weights` (and torch's init
functions) for no-ops while it loads and puts back what it found: two loads overlapping in
threads left the no-op in place for good, and every later model loaded with an untied head.
The Session does load in two threads (the models' save while Ray starts, and the weight
count for Ray's memory): this is what made CI's full suite load a tied head untied.

comlrl 1.4.3, run in its own virtualenv (benchmarks/.venv-comlrl) with this test's tied model
given twice by name, agent_devices="cpu": its constructor called
`AutoModelForCausalLM.from_pretrained` 2 times (counted), `trainer.agents` held 2 distinct
models, both heads tied (shared data_ptr). Here the load happens at first use, so it must give
the same: one model object per agent, tied, whichever thread asks first.
"""

from __future__ import annotations

import threading

THREADS = 4


def test_concurrent_first_use_loads_each_model_once_and_leaves_tying_intact(tmp_path):
    import torch
    from transformers import PreTrainedModel

    from comlrl.tiny_model import build_tiny_model
    from comlrl.trainers.reinforce import MAGRPOTrainer
    from tests.test_comlrl_compat_train import _config, _data, reward

    tied = str(build_tiny_model(tmp_path / "tied", vocab_size=600, tie_word_embeddings=True))
    original_tie = PreTrainedModel.tie_weights
    trainer = MAGRPOTrainer(agents=[tied, tied], reward_func=reward, train_dataset=_data(),
                            args=_config(eval_interval=0))
    assert trainer.agents is None                 # loaded at first use, not here

    start, results, errors = threading.Barrier(THREADS), [None] * THREADS, []

    def first_use(i):
        try:
            start.wait()
            results[i] = trainer._initial_models()
        except BaseException as error:            # surfaced below, not lost in the thread
            errors.append(error)

    threads = [threading.Thread(target=first_use, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors

    models = results[0]
    assert len(models) == 2 and models[0] is not models[1]
    # Every thread got the very same objects: each agent was loaded once, not per caller.
    assert all(r is models for r in results)
    assert PreTrainedModel.tie_weights is original_tie
    for model in models:
        head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
        assert head.data_ptr() == embed.data_ptr()
    # And a model loaded after them still ties its head (the class was left as found).
    from comlrl.loading import load_causal_lm

    later = load_causal_lm(tied, dtype=torch.float32)
    assert (later.get_output_embeddings().weight.data_ptr()
            == later.get_input_embeddings().weight.data_ptr())
