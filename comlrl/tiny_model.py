"""Build a tiny random-weight Qwen2-style model and tokenizer on disk.

No model hub is reachable on the machines this project is tested on, so tests, examples and
benchmarks build their model here and load it through the same `from_pretrained` path a real
model takes. The result is a function of its arguments alone (same seed, same bytes).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# A small fixed corpus so the BPE merges (and so the vocabulary) never change between runs.
_CORPUS = [
    "Describe a city in the clouds: towers of mist, bridges of light, people who walk on air.",
    "Invent a new holiday and explain it: every year we celebrate the day the rivers sing.",
    "Write a bedtime story for a dragon: once upon a time a small dragon could not sleep.",
    "Design a playground on Mars: red sand, low gravity swings, domes full of green trees.",
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine.",
    "Agents cooperate to solve tasks; the first writes a short answer, the second a longer one.",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" # $ % & @ ^ _ ` | ~",
] * 8

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_model(
    output_dir: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int = 512,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
) -> Path:
    """Write a random-weight Qwen2 causal LM and its tokenizer to `output_dir`.

    The tokenizer is a byte-level BPE trained on a fixed corpus, with a chat template and
    `<|endoftext|>` as both eos and pad. `hidden_size / num_heads` must be >= 32: vLLM's CPU
    attention needs head_dim >= 32. Returns the folder, loadable by `from_pretrained`.

    The corpus yields a few hundred BPE tokens (538); a larger `vocab_size` (a real model's
    151936, say) is filled up with plain added tokens `<|filler_ID|>` (not special, so they
    decode like text), so that len(tokenizer) == vocab_size and every id the model can
    sample decodes, as vLLM requires. `tie_word_embeddings`: the head shares the embedding
    matrix (Qwen2.5-0.5B's layout); the checkpoint then stores it once.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    _check_head_dim(hidden_size, num_heads)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _write_tokenizer(out, vocab_size)

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=tie_word_embeddings,
        torch_dtype="float32",
    )
    # Seeded generator -> same weights for the same seed, whatever the process did before.
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Qwen2ForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    (out / "tiny_model.json").write_text(
        json.dumps({"seed": seed, "hidden_size": hidden_size, "num_layers": num_layers})
    )
    return out


def _check_head_dim(hidden_size: int, num_heads: int) -> None:
    """Refuse a head_dim that is not whole or is below vLLM's CPU attention minimum (32)."""
    if hidden_size % num_heads or hidden_size // num_heads < 32:
        raise ValueError(
            f"hidden_size={hidden_size} / num_heads={num_heads} must be a whole head_dim >= 32 "
            "(vLLM's CPU attention); raise hidden_size or lower num_heads."
        )


def _write_tokenizer(out: Path, vocab_size: int):
    """Train the byte-level BPE on `_CORPUS`, fill it up to `vocab_size` with filler tokens,
    wrap it with the chat template and eos = pad = `<|endoftext|>`, save it into `out` and
    return it (a `PreTrainedTokenizerFast`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS, trainer=trainer)
    trained = bpe.get_vocab_size()
    if trained < vocab_size:
        # Only past what the corpus yields, so the smaller vocabularies' files are unchanged.
        from tokenizers import AddedToken

        bpe.add_tokens([AddedToken(f"<|filler_{i}|>", special=False, normalized=False)
                        for i in range(trained, vocab_size)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=specials[1:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=build_tiny_model.__doc__)
    parser.add_argument("output_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=None,
                        help="MLP width (default: 3 x hidden size)")
    parser.add_argument("--vocab-size", type=int, default=512,
                        help="past the corpus's 538 BPE tokens, filled with <|filler_ID|>")
    parser.add_argument("--tie-word-embeddings", action="store_true",
                        help="the head shares the embedding matrix")
    a = parser.parse_args()
    print(build_tiny_model(a.output_dir, seed=a.seed, hidden_size=a.hidden_size,
                           num_layers=a.num_layers, num_heads=a.num_heads,
                           num_kv_heads=a.num_kv_heads, intermediate_size=a.intermediate_size,
                           vocab_size=a.vocab_size,
                           tie_word_embeddings=a.tie_word_embeddings))


if __name__ == "__main__":
    main()
