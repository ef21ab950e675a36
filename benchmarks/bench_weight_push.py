"""Seconds to push weights from a learner to a rollout worker, against state-dict bytes.

The trainer's path, on real actors (`workers.launch.start_actor` with `workers.learner.Learner`
and `workers.rollout.RolloutWorker` hosting a vLLM engine): the learner copies its state dict
to CPU tensors and Ray puts them in the object store (`get_weights`); the worker receives them
and vLLM reloads them (`update_weights` -> `reload_weights`, prefix cache reset). Next to it, a
plain in-memory copy of the same bytes (`torch.clone` of every tensor, in this process), the
floor for any transport that copies once.

Split of one push: export (learner copy + put, timed with `ray.wait` on the ref without
fetching it), reload (measured inside the worker), and the rest (transfer, deserialisation,
Ray calls). Median and spread of --repeats pushes after one warm-up push.

    python benchmarks/bench_weight_push.py [--short] [--sizes 0.43M,10M,76.6M] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

bl.apply_env()


def clone_seconds(folder: Path, repeats: int) -> tuple[float, int]:
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    {k: v.clone() for k, v in state.items()}
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        copy = {k: v.clone() for k, v in state.items()}
        times.append(time.perf_counter() - t)
        del copy
    return bl.median(times), nbytes


def bench_size(size: str, repeats: int, threads: int) -> dict:
    import ray

    from workers.launch import Placement, kill_actors, start_actor
    from workers.learner import Learner
    from workers.rollout import RolloutWorker

    folder = bl.model_path(size)
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(folder).eos_token_id
    sampling = dict(max_new_tokens=64, temperature=0.6, top_p=0.6, top_k=50,
                    stop_token_ids=(eos,))
    engine_kwargs = dict(dtype="auto", enforce_eager=True, kv_cache_memory_bytes=256 << 20,
                         seed=0, threads=threads)
    t = time.perf_counter()
    learner = start_actor(Learner, Placement(num_cpus=0.5), 0, str(folder),
                          learning_rate=5e-6, train_batch_size=2, threads=threads)
    worker = start_actor(RolloutWorker, Placement(num_cpus=0.5), 0, str(folder), "vllm",
                         sampling, engine_kwargs)
    ray.get([learner.get_version.remote(), worker.get_version.remote()])
    actors_s = time.perf_counter() - t
    pushes = []
    try:
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            ref = learner.get_weights.remote()
            ray.wait([ref], fetch_local=False)
            t1 = time.perf_counter()
            reload_s = ray.get(worker.update_weights.remote(i + 1, ref))
            t2 = time.perf_counter()
            del ref
            if i:                                  # the first push warms up
                pushes.append({"total_s": t2 - t0, "export_s": t1 - t0, "reload_s": reload_s,
                               "transfer_s": (t2 - t1) - reload_s})
        # The engine must still generate after the pushes.
        out = ray.get(worker.generate.remote([{"prompt_ids": [1, 2, 3], "n": 2, "seed": 1}]))
        assert out["version"] == repeats + 1 and len(out["outputs"][0]) == 2
    finally:
        kill_actors([learner, worker])
    clone_s, nbytes = clone_seconds(folder, repeats)
    agg = {k: bl.median([p[k] for p in pushes]) for k in pushes[0]}
    return {"params": bl.param_count(folder), "bytes": nbytes, "actors_start_s": actors_s,
            **agg, "total_min_s": min(p["total_s"] for p in pushes),
            "total_max_s": max(p["total_s"] for p in pushes), "clone_s": clone_s,
            "push_gbs": nbytes / agg["total_s"] / 1e9, "clone_gbs": nbytes / clone_s / 1e9,
            "pushes": pushes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--short", action="store_true", help="smallest model, 2 timed pushes")
    p.add_argument("--sizes", help=f"comma list of {', '.join(bl.SIZES)} (default: all)")
    p.add_argument("--repeats", type=int, default=5, help="timed pushes per size")
    p.add_argument("--threads", type=int, default=1, help="torch threads per actor")
    a = p.parse_args()
    sizes = bl.parse_sizes(a.sizes, a.short)
    repeats = 2 if a.short else a.repeats
    for s in sizes:
        bl.model_path(s)

    from workers.launch import ensure_ray

    import ray

    t = time.perf_counter()
    ensure_ray(None)                       # the trainer's own local Ray (loopback, no auth)
    ray_s = time.perf_counter() - t
    results, rows = {}, []
    try:
        for size in sizes:
            r = bench_size(size, repeats, a.threads)
            results[size] = r
            rows.append([size, f"{r['params']:,}", f"{r['bytes'] / 1e6:.1f}", r["total_s"],
                         f"{bl.fmt(r['total_min_s'])}-{bl.fmt(r['total_max_s'])}",
                         r["export_s"], r["transfer_s"], r["reload_s"], r["clone_s"],
                         f"{r['total_s'] / r['clone_s']:.1f}x", r["push_gbs"], r["clone_gbs"]])
    finally:
        ray.shutdown()
    print("\n## Weight push: learner -> object store -> rollout worker -> vLLM reload\n")
    print(bl.table(["model", "params", "MB", "push s", "spread", "export s", "transfer s",
                    "vLLM reload s", "torch clone s", "push/clone", "push GB/s",
                    "clone GB/s"], rows))
    print(f"\nray.init {ray_s:.1f} s; learner + rollout actor start: "
          + ", ".join(f"{s} {results[s]['actors_start_s']:.1f} s" for s in sizes))
    path = bl.write_results("bench_weight_push" + ("_short" if a.short else ""),
                            {"repeats": repeats, "threads": a.threads, "ray_init_s": ray_s,
                             "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
