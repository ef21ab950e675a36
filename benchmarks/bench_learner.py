"""One learner step, batched (workers/roles/learner.py) against a per-completion loop
(comlrl 1.4.3).

Same model, same samples: one agent's mini-batch of the seed run (train_batch_size=2 prompt
groups x K=4 completions of up to 64 tokens, some cut at EOS). The batched step is
what our learner does: `comlrl.magrpo.pad_batch` -> one padded forward -> `token_logprobs`
-> `policy_loss` -> backward. The loop does what comlrl 1.4.3 does: one forward per
completion over prompt + completion[:-1], the log-probs of its tokens summed, minus that times
the advantage, averaged within the group, 1/len(batch) per group, backward per group.

The losses must agree to 1e-6 (relative to max(1, |loss|)) and the gradients closely, checked
in float64 so that a real difference cannot hide behind float32 rounding; the float32 gap is
printed too. Both are then timed in float32. (`token_logprobs` computes its log-softmax in
float32 even for float64 logits, which leaves a float64 gap of ~5e-7; without that cast the
two agree to ~1e-14.)

    python benchmarks/bench_learner.py [--short] [--sizes 0.43M,10M,76.6M] [--threads 1]
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

bl.apply_env()

LOSS_TOL = 1e-6          # |loss_batched - loss_loop| / max(1, |loss_loop|), float64
GRAD_TOL = 1e-5          # max |g_batched - g_loop| / max |g_loop|, float64
PROMPTS = ["Describe a city in the clouds:", "Invent a new holiday and explain it:"]
K = 4


def make_samples(tokenizer, vocab: int, seed: int = 0) -> list[dict]:
    """Two prompt groups of K completions each, lengths like the seed run's (random-weight
    models rarely stop early: mean length ~57 of 64): 64 tokens, or 16-63 ending in EOS."""
    import torch

    g = torch.Generator().manual_seed(seed)
    eos = tokenizer.eos_token_id
    groups = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        comps = []
        for j in range(K):
            early = float(torch.rand((), generator=g)) < 0.4
            n = int(torch.randint(16, 64, (1,), generator=g)) if early else 64
            toks = torch.randint(3, vocab, (n,), generator=g).tolist()
            if early:
                toks[-1] = eos
            comps.append(toks)
        adv = torch.randn(K, generator=g, dtype=torch.float64)
        adv = ((adv - adv.mean()) / adv.std(unbiased=False)).tolist()
        groups.append({"prompt_ids": ids, "completions": comps, "advantages": adv})
    return groups


def batched_loss(model, groups, pad_id: int):
    """Our learner's computation (workers/roles/learner.py Learner.update, one mini-batch)."""
    import torch

    from comlrl.magrpo import pad_batch, policy_loss, token_logprobs

    prompts = [g["prompt_ids"] for g in groups for _ in g["completions"]]
    comps = [c for g in groups for c in g["completions"]]
    dtype = next(model.parameters()).dtype
    adv = torch.tensor([a for g in groups for a in g["advantages"]], dtype=dtype)
    ids, attn, target = pad_batch(prompts, comps, pad_id)
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    tok_logp = token_logprobs(logits.to(dtype), ids).to(dtype)
    loss = policy_loss(tok_logp, target.to(dtype), adv, [len(g["completions"]) for g in groups])
    loss.backward()
    return loss.detach()


def loop_loss(model, groups):
    """comlrl 1.4.3's way: one forward per completion, backward per group (written anew)."""
    import torch

    dtype = next(model.parameters()).dtype
    total = torch.zeros((), dtype=dtype)
    scale = 1.0 / len(groups)
    for g in groups:
        prompt = torch.tensor(g["prompt_ids"])
        group_loss = torch.zeros((), dtype=dtype)
        for comp, adv in zip(g["completions"], g["advantages"]):
            comp_t = torch.tensor(comp)
            inputs = torch.cat([prompt, comp_t[:-1]]).unsqueeze(0)
            logits = model(input_ids=inputs, attention_mask=torch.ones_like(inputs),
                           use_cache=False).logits[0]
            # Position p predicts token p+1: the completion's tokens are predicted from
            # positions len(prompt)-1 .. end.
            pred = logits[len(prompt) - 1:].to(dtype).log_softmax(-1)
            seq = pred.gather(-1, comp_t.unsqueeze(-1)).sum()
            group_loss = group_loss - seq * adv
        group_loss = group_loss / len(g["completions"])
        (group_loss * scale).backward()
        total = total + group_loss.detach() * scale
    return total


def grads(model):
    import torch

    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def check_agreement(model, groups, pad_id: int, dtype) -> dict:
    import torch

    m_b = copy.deepcopy(model).to(dtype).train()
    m_l = copy.deepcopy(model).to(dtype).train()
    lb = batched_loss(m_b, groups, pad_id)
    ll = loop_loss(m_l, groups)
    gb, gl = grads(m_b), grads(m_l)
    return {"loss_batched": float(lb), "loss_loop": float(ll),
            "loss_abs_diff": abs(float(lb) - float(ll)),
            "loss_rel_diff": abs(float(lb) - float(ll)) / max(1.0, abs(float(ll))),
            "grad_max_rel_diff": float((gb - gl).abs().max() / gl.abs().max()),
            "grad_cosine": float(torch.nn.functional.cosine_similarity(
                gb.double(), gl.double(), dim=0))}


def time_step(fn, model, reps: int) -> float:
    times = []
    for _ in range(reps + 1):
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        fn(model)
        times.append(time.perf_counter() - t)
    return bl.median(times[1:])        # the first call warms up


def bench_size(size: str, reps: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = bl.model_path(size)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    pad_id = tok.pad_token_id
    groups = make_samples(tok, model.config.vocab_size)
    f64 = check_agreement(model, groups, pad_id, torch.float64)
    f32 = check_agreement(model, groups, pad_id, torch.float32)
    ok = f64["loss_rel_diff"] <= LOSS_TOL and f64["grad_max_rel_diff"] <= GRAD_TOL
    t_batched = time_step(lambda m: batched_loss(m, groups, pad_id), model, reps)
    t_loop = time_step(lambda m: loop_loss(m, groups), model, reps)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-6, weight_decay=0.01)
    batched_loss(model, groups, pad_id)
    opt.step()                         # first step allocates the moments
    t = time.perf_counter()
    opt.step()
    t_opt = time.perf_counter() - t
    tokens = sum(len(c) for g in groups for c in g["completions"])
    return {"params": bl.param_count(folder), "sequences": K * len(groups),
            "completion_tokens": tokens, "float64": f64, "float32": f32, "agree": ok,
            "batched_s": t_batched, "loop_s": t_loop, "speedup": t_loop / t_batched,
            "adamw_step_s": t_opt}


def main() -> None:
    p = bl.size_parser(__doc__, "smallest model, 2 timed repeats")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (median)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: what each of the 2 learner actors gets here)")
    a = p.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    sizes = bl.parse_sizes(a.sizes, a.short)
    reps = 2 if a.short else a.repeats
    results, rows, failed = {}, [], []
    monitor = bl.ForeignCPU().__enter__()
    for size in sizes:
        r = bench_size(size, reps)
        results[size] = r
        rows.append([size, f"{r['params']:,}", f"{r['sequences']}/{r['completion_tokens']}",
                     f"{r['float64']['loss_batched']:.9f}", f"{r['float64']['loss_abs_diff']:.1e}",
                     f"{r['float64']['loss_rel_diff']:.1e}", f"{r['float32']['loss_rel_diff']:.1e}",
                     f"{r['float64']['grad_max_rel_diff']:.1e}",
                     f"{r['float32']['grad_max_rel_diff']:.1e}",
                     r["batched_s"], r["loop_s"], f"{r['speedup']:.2f}x", r["adamw_step_s"]])
        if not r["agree"]:
            failed.append(size)
    monitor.__exit__(None, None, None)
    print(f"\n## Learner step: one padded forward vs one forward per completion "
          f"({a.threads} thread{'s' if a.threads > 1 else ''})\n")
    print(bl.table(["model", "params", "seqs/tokens", "loss (f64)", "|dloss| f64",
                    "rel dloss f64", "rel dloss f32", "grad rel diff f64",
                    "grad rel diff f32", "batched s", "loop s",
                    "speedup", "AdamW step s"], rows))
    print(f"\nlosses agree to {LOSS_TOL:g} (relative, float64) and gradients to {GRAD_TOL:g}: "
          f"{'yes' if not failed else 'NO for ' + ', '.join(failed)}")
    path = bl.write_results(bl.result_name("bench_learner", a.short, sizes),
                            {"threads": a.threads, "repeats": reps, "loss_tol": LOSS_TOL,
                             "grad_tol": GRAD_TOL, "results": results,
                             "foreign_cpu": monitor.report()})
    print(monitor.line())
    print(f"wrote {path}")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
