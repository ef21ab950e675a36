"""tiny_model's larger vocabularies and tied head: the default builds keep their bytes, and a
padded, tied build loads like a real model (every id the model can sample decodes)."""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

# The last commit before build_tiny_model learned tie_word_embeddings and filler tokens: its
# builds are the reference the default calls must still reproduce byte for byte.
REFERENCE_COMMIT = "887d174"

DEFAULT_CALLS = [
    {},                                                       # the tests' fixture
    dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
         intermediate_size=256),                              # benchmarks' 0.43M
    dict(seed=1, vocab_size=300, hidden_size=64, num_heads=2),  # another seed, a smaller vocab
]


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file()}


def _reference_builder(tmp_path: Path):
    try:
        source = subprocess.run(
            ["git", "show", f"{REFERENCE_COMMIT}:comlrl/tiny_model.py"], cwd=ROOT,
            capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"needs the git history ({REFERENCE_COMMIT})")
    path = tmp_path / "tiny_model_reference.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("tiny_model_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_tiny_model


def test_default_builds_are_byte_identical_to_before(tmp_path):
    from comlrl.tiny_model import build_tiny_model

    reference = _reference_builder(tmp_path)
    for i, kwargs in enumerate(DEFAULT_CALLS):
        before = reference(tmp_path / f"before-{i}", **kwargs)
        after = build_tiny_model(tmp_path / f"after-{i}", **kwargs)
        old, new = _digests(before), _digests(after)
        assert set(old) == set(new), (kwargs, sorted(set(old) ^ set(new)))
        changed = sorted(name for name in old if old[name] != new[name])
        assert not changed, f"{kwargs}: these files changed: {changed}"


def test_padded_vocabulary_with_tied_head_loads_like_a_real_model(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from comlrl.tiny_model import build_tiny_model

    folder = build_tiny_model(tmp_path / "v4096", vocab_size=4096, tie_word_embeddings=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    assert model.config.vocab_size == 4096 and model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight.shape == (4096, 128)
    # One tensor, not two equal ones (the head is the embedding). CI's full suite once loaded
    # it untied: overlapping `from_pretrained` calls in threads (tests/test_model_loading.py).
    assert (model.get_output_embeddings().weight.data_ptr()
            == model.get_input_embeddings().weight.data_ptr())
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in set(f.keys())        # stored once

    assert len(tokenizer) == 4096
    top = len(tokenizer) - 1
    text = tokenizer.decode([top])
    assert text == f"<|filler_{top}|>"
    assert tokenizer.encode(text, add_special_tokens=False) == [top]
    # A filler in the middle of text decodes in place and the text around it still encodes.
    ids = tokenizer.encode("a city in the clouds", add_special_tokens=False)
    assert tokenizer.decode(ids + [top] + ids) == f"a city in the clouds{text}a city in the clouds"
    # Fillers are plain tokens: skip_special_tokens keeps them; eos/pad stay what they were.
    assert tokenizer.decode([top], skip_special_tokens=True) == text
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    ).endswith("<|im_start|>assistant\n")

    # Every id the model can sample decodes, and the model runs over the top ids.
    assert all(isinstance(s, str) for s in tokenizer.convert_ids_to_tokens(list(range(4096))))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[top, top - 1, 0]])).logits
    assert logits.shape == (1, 3, 4096)


def test_cli_takes_intermediate_size_vocab_and_tie(tmp_path):
    import json
    import sys

    out = tmp_path / "cli"
    subprocess.run([sys.executable, "-m", "comlrl.tiny_model", str(out), "--hidden-size", "64",
                    "--num-heads", "2", "--intermediate-size", "96", "--vocab-size", "600",
                    "--tie-word-embeddings"], cwd=ROOT, check=True, capture_output=True)
    config = json.loads((out / "config.json").read_text())
    assert (config["intermediate_size"], config["vocab_size"],
            config["tie_word_embeddings"]) == (96, 600, True)
