"""Seconds to push weights from a learner to a rollout worker, against state-dict bytes.

The trainer's path, on real actors (`workers.ray_calls.start_actor` with
`workers.roles.learner.Learner` and `workers.roles.rollout_worker.RolloutWorker` hosting a vLLM
engine): the learner copies its state dict to CPU tensors and Ray puts them in the object store (`get_weights`); the worker receives them
and vLLM reloads them (`update_weights` -> `reload_weights`, prefix cache reset). Next to it, a
plain in-memory copy of the same bytes (`torch.clone` of every tensor, in this process), the
floor for any transport that copies once (and a copy_ into tensors allocated beforehand).

As in the trainer, every agent's learner pushes at once to its own worker (--agents, default
2 like the seed run); the clone copies the same total bytes. Split of one push: export (learner
copy + put, timed with `ray.wait` on the refs without fetching them), reload (measured inside
the workers, the slowest one), and the rest (transfer, deserialisation, Ray calls). Median
and spread of --repeats pushes after one warm-up push. Also: one empty actor call's round trip.

    python benchmarks/bench_weight_push.py [--short] [--sizes 0.43M,10M,76.6M] [--agents 2]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

bl.apply_env()


def clone_seconds(folder: Path, repeats: int, copies: int) -> tuple[float, float, int]:
    """Seconds to torch.clone every tensor of the state dict `copies` times, and to copy it
    into tensors allocated beforehand (no page faults: fresh memory is slow on this VM);
    bytes of one state dict."""
    import torch
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    dst = [{k: torch.empty_like(v).copy_(v) for k, v in state.items()} for _ in range(copies)]
    clone, into = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        copy = [{k: v.clone() for k, v in state.items()} for _ in range(copies)]
        clone.append(time.perf_counter() - t)
        del copy
        t = time.perf_counter()
        for d in dst:
            for k, v in state.items():
                d[k].copy_(v)
        into.append(time.perf_counter() - t)
    return bl.median(clone), bl.median(into), nbytes


def bench_size(size: str, repeats: int, threads: int, agents: int) -> dict:
    import ray
    from transformers import AutoTokenizer

    from workers.driver.placement import Placement
    from workers.ray_calls import kill_actors, start_actor
    from workers.roles.learner import Learner
    from workers.roles.rollout_worker import RolloutWorker

    folder = bl.model_path(size)
    eos = AutoTokenizer.from_pretrained(folder).eos_token_id
    sampling = dict(max_new_tokens=64, temperature=0.6, top_p=0.6, top_k=50,
                    stop_token_ids=(eos,))
    engine_kwargs = dict(dtype="auto", enforce_eager=True, kv_cache_memory_bytes=256 << 20,
                         seed=0, threads=threads)
    t = time.perf_counter()
    learners = [start_actor(Learner, Placement(num_cpus=0.5), a, str(folder),
                            learning_rate=5e-6, train_batch_size=2, threads=threads)
                for a in range(agents)]
    workers = [start_actor(RolloutWorker, Placement(num_cpus=0.5), a, str(folder), "vllm",
                           sampling, engine_kwargs) for a in range(agents)]
    ray.get([x.get_version.remote() for x in learners + workers])
    actors_s = time.perf_counter() - t
    pushes, rtt = [], []
    try:
        for _ in range(21):                        # one empty actor call, there and back
            t = time.perf_counter()
            ray.get(workers[0].get_version.remote())
            rtt.append(time.perf_counter() - t)
        for i in range(repeats + 1):
            # As the trainer pushes: every learner's weights at once, each to its engine.
            t0 = time.perf_counter()
            refs = [l.get_weights.remote() for l in learners]
            ray.wait(refs, num_returns=len(refs), fetch_local=False)
            t1 = time.perf_counter()
            reloads = ray.get([w.update_weights.remote(i + 1, r) for w, r in zip(workers, refs)])
            t2 = time.perf_counter()
            del refs
            if i:                                  # the first push warms up
                pushes.append({"total_s": t2 - t0, "export_s": t1 - t0,
                               "reload_s": max(reloads), "transfer_s": (t2 - t1) - max(reloads)})
        # The engines must still generate after the pushes.
        outs = ray.get([w.generate.remote([{"prompt_ids": [1, 2, 3], "n": 2, "seed": 1}])
                        for w in workers])
        assert all(o["version"] == repeats + 1 and len(o["outputs"][0]) == 2 for o in outs)
    finally:
        kill_actors(learners + workers)
    clone_s, copy_s, nbytes = clone_seconds(folder, repeats, agents)
    agg = {k: bl.median([p[k] for p in pushes]) for k in pushes[0]}
    return {"params": bl.param_count(folder), "bytes": nbytes, "agents": agents,
            "actors_start_s": actors_s, "ray_call_rtt_s": bl.median(rtt[1:]),
            **agg, "total_min_s": min(p["total_s"] for p in pushes),
            "total_max_s": max(p["total_s"] for p in pushes), "clone_s": clone_s,
            "copy_into_s": copy_s,
            "push_gbs": agents * nbytes / agg["total_s"] / 1e9,
            "clone_gbs": agents * nbytes / clone_s / 1e9, "pushes": pushes}


def main() -> None:
    p = bl.size_parser(__doc__, "smallest model, 2 timed pushes")
    p.add_argument("--repeats", type=int, default=5, help="timed pushes per size")
    p.add_argument("--threads", type=int, default=1, help="torch threads per actor")
    p.add_argument("--agents", type=int, default=2,
                   help="learner/worker pairs pushed at once (the seed run has 2)")
    a = p.parse_args()
    sizes = bl.parse_sizes(a.sizes, a.short)
    repeats = 2 if a.short else a.repeats
    for s in sizes:
        bl.model_path(s)

    from workers.driver.cluster import ensure_ray

    import ray

    monitor = bl.ForeignCPU().__enter__()
    t = time.perf_counter()
    # The trainer's own local Ray (loopback, no auth), its object store sized as the trainer
    # sizes it for the largest model pushed here.
    biggest = max(4 * bl.param_count(bl.model_path(s)) for s in sizes)
    ensure_ray(None, a.agents * biggest)
    ray_s = time.perf_counter() - t
    results, rows = {}, []
    try:
        for size in sizes:
            r = bench_size(size, repeats, a.threads, a.agents)
            results[size] = r
            rows.append([size, f"{r['params']:,}", f"{r['bytes'] / 1e6:.1f}", r["total_s"],
                         f"{bl.fmt(r['total_min_s'])}-{bl.fmt(r['total_max_s'])}",
                         r["export_s"], r["transfer_s"], r["reload_s"], r["clone_s"],
                         r["copy_into_s"], f"{r['total_s'] / r['clone_s']:.1f}x",
                         r["push_gbs"], r["clone_gbs"]])
    finally:
        ray.shutdown()
        monitor.__exit__(None, None, None)
    print(f"\n## Weight push: learner -> object store -> rollout worker -> vLLM reload "
          f"({a.agents} agent{'s' if a.agents > 1 else ''} at once)\n")
    print(bl.table(["model", "params", "MB per agent", "push s", "spread", "export s",
                    "transfer s", "vLLM reload s", "torch clone s", "copy_ into s", "push/clone",
                    "push GB/s", "clone GB/s"], rows))
    print(f"\nray.init {ray_s:.1f} s; learner + rollout actor start: "
          + ", ".join(f"{s} {results[s]['actors_start_s']:.1f} s" for s in sizes)
          + "; empty actor call round trip: "
          + ", ".join(f"{results[s]['ray_call_rtt_s'] * 1e3:.2f} ms" for s in sizes))
    path = bl.write_results(bl.result_name("bench_weight_push", a.short, sizes),
                            {"repeats": repeats, "threads": a.threads, "agents": a.agents,
                             "ray_init_s": ray_s, "results": results,
                             "foreign_cpu": monitor.report()})
    print(monitor.line())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
