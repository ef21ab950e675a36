"""Generation tokens per second: the vLLM engine against Hugging Face `generate`.

Both are this project's engines (`workers.engines.VLLMEngine` and `HFEngine`) with the seed
config's sampling (temperature 0.6, top_p 0.6, top_k 50, 64 new tokens, n=4 per prompt), fed
1, 4 and 16 prompts per call (the seed prompts, repeated). Each (engine, model) runs in its own
subprocess because an in-process vLLM engine changes its host's torch threads and RNG; torch
gets --threads threads there (default 1: what each of the 2 rollout workers gets on this
2-core machine). One untimed call warms each batch size up; the median of the timed calls is
reported.

    python benchmarks/bench_rollout.py [--short] [--sizes 0.43M,10M,76.6M] [--batches 1,4,16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

bl.apply_env()

PROMPTS = [
    "Describe a city in the clouds:",
    "Invent a new holiday and explain it:",
    "Write a bedtime story for a dragon:",
    "Design a playground on Mars:",
]
N = 4
MAX_NEW_TOKENS = 64


def child(engine_name: str, size: str, batches: list[int], repeats: int, threads: int) -> dict:
    """Runs in a fresh process: build one engine, time every batch size."""
    import torch
    from transformers import AutoTokenizer

    from workers.engines import ENGINE_ENV, SamplingSettings, make_engine

    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    torch.set_num_threads(threads)
    folder = bl.model_path(size)
    tok = AutoTokenizer.from_pretrained(folder)
    sampling = SamplingSettings(max_new_tokens=MAX_NEW_TOKENS, temperature=0.6, top_p=0.6,
                                top_k=50, stop_token_ids=(tok.eos_token_id,))
    t = time.perf_counter()
    engine = make_engine(engine_name, str(folder), sampling, threads=threads,
                         kv_cache_memory_bytes=256 * 1024 * 1024, seed=0)
    start_s = time.perf_counter() - t
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    out = {"engine": engine_name, "size": size, "start_s": start_s,
           "torch_threads": torch.get_num_threads(), "batches": {}}
    for b in batches:
        requests = [{"prompt_ids": ids[i % len(ids)], "n": N, "seed": 1000 * i}
                    for i in range(b)]
        engine.generate(requests)                       # warm-up
        secs, toks = [], []
        for r in range(repeats):
            reqs = [{**q, "seed": q["seed"] + 7 * (r + 1)} for q in requests]
            t = time.perf_counter()
            res = engine.generate(reqs)
            secs.append(time.perf_counter() - t)
            toks.append(sum(len(s["token_ids"]) for o in res for s in o))
        rates = [k / s for k, s in zip(toks, secs)]
        out["batches"][b] = {"seconds": bl.median(secs), "tokens": bl.median(toks),
                             "tokens_per_s": bl.median(rates), "min": min(rates),
                             "max": max(rates)}
    engine.shutdown()
    return out


def main() -> None:
    p = bl.size_parser(__doc__, "smallest model, batches 1 and 4, 1 timed call each")
    p.add_argument("--batches", default="1,4,16", help="prompts per call (n=4 each)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per batch size")
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--engines", default="vllm,hf")
    p.add_argument("--child", nargs=2, metavar=("ENGINE", "SIZE"), help=argparse.SUPPRESS)
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    repeats = a.repeats
    if a.short:
        batches, repeats = [1, 4], 1
    if a.child:
        print("RESULT " + json.dumps(child(a.child[0], a.child[1], batches, repeats,
                                           a.threads)))
        return
    sizes = bl.parse_sizes(a.sizes, a.short)
    engines = [e.strip() for e in a.engines.split(",")]
    results, rows = {}, []
    monitor = bl.ForeignCPU().__enter__()
    for size in sizes:
        bl.model_path(size)
        results[size] = {}
        for eng in engines:
            cmd = [sys.executable, __file__, "--child", eng, size, "--batches",
                   ",".join(map(str, batches)), "--repeats", str(repeats),
                   "--threads", str(a.threads)]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=bl.ROOT)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode != 0 or not line:
                sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
                raise SystemExit(f"{eng} on {size} failed (exit {proc.returncode})")
            results[size][eng] = json.loads(line[-1][7:])
        for b in batches:
            row = [size, f"{b} x n={N}"]
            rates = {}
            for eng in engines:
                r = results[size][eng]["batches"][str(b)]      # JSON keys are strings
                rates[eng] = r["tokens_per_s"]
                row += [r["tokens_per_s"], r["seconds"]]
            if "vllm" in rates and "hf" in rates:
                row.append(f"{rates['vllm'] / rates['hf']:.2f}x")
            rows.append(row)
    monitor.__exit__(None, None, None)
    cols = ["model", "prompts/call"]
    for eng in engines:
        cols += [f"{eng} tok/s", f"{eng} s/call"]
    if "vllm" in engines and "hf" in engines:
        cols.append("vllm/hf")
    print(f"\n## Generation throughput ({a.threads} torch thread{'s' if a.threads > 1 else ''}"
          f" per engine, {MAX_NEW_TOKENS} new tokens)\n")
    print(bl.table(cols, rows))
    starts = [[s, *(results[s][e]["start_s"] for e in engines)] for s in sizes]
    print("\nengine start-up s:\n")
    print(bl.table(["model", *engines], starts))
    path = bl.write_results(bl.result_name("bench_rollout", a.short, sizes),
                            {"threads": a.threads, "repeats": repeats, "n": N,
                             "max_new_tokens": MAX_NEW_TOKENS, "results": results,
                             "foreign_cpu": monitor.report()})
    print("\n" + monitor.line())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
