"""The seed example end to end: this project against comlrl 1.4.3, same user script, same run.

For each model size, `seed_user_script.py` (2 agents, the 4 seed prompts, K=4, 64 new tokens,
one turn, logging_steps=1, the length-ratio reward, W&B offline in a temp WANDB_DIR) runs in
its own subprocess, once with this project's .venv and once with benchmarks/.venv-comlrl
(comlrl 1.4.3, created on first use with the same torch and transformers). Epoch times come
from the `_timestamp` of each logged step in the run's W&B file (`wandb leet inspect --json`):
both libraries log once per rollout buffer, so the last point of epoch k closes epoch k.

Sides: `ours` (this project with its defaults: `colocate='auto'`, which on this local CPU
run hosts each agent's learner in its engine's actor), `split` (`colocate=False`: learners and
engines in separate actors), `colocated` (`colocate=True`), `bf16` (the defaults with the
opt-in `engine_dtype='bfloat16'`) and `comlrl`.

Per side: start-up (constructing the trainer to the end of epoch 1, minus one steady epoch),
time to the first logged step, seconds per epoch in steady state (epochs 2..N), total train()
time, and the ratio comlrl / ours; median and (min-max) spread over --repeats. It also
measures the floor of this machine in the same run: fp32 matmul GFLOP/s on 2 threads, memory
copy GB/s, and one forward+backward of each model over 16 sequences of 80 tokens.

Then, per size, the whole seed example as the user runs it (`--whole-sizes`): 2 epochs with a
checkpoint each, then a new trainer resumes from the newest to 4 epochs, in one process timed
from start to exit, with each train(), the time from each train() to its first step, and the
exit (from the script's last line to the end of the process).

    python benchmarks/bench_seed.py [--short] [--sizes 0.43M,10M,76.6M] [--repeats 3]
                                    [--sides ours,split,comlrl]
                                    [--checkpoint] [--whole-sizes 10M]
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402
from examples.training_curve import wandb_history  # noqa: E402

bl.apply_env()

COMLRL_VENV = bl.BENCH_DIR / ".venv-comlrl"
USER_SCRIPT = bl.BENCH_DIR / "seed_user_script.py"
PROMPTS, K = 4, 4
STEPS_PER_EPOCH = PROMPTS * K          # env_steps per epoch (aligned, one turn)
DEFAULT_EPOCHS = {"0.43M": 6, "10M": 5, "76.6M": 4}
WHOLE_EPOCHS = (2, 4)                  # the seed example: 2 epochs, then resume to 4
UNINSTALL = ("torchvision", "torchaudio", "torchcodec")
OURS = ("ours", "split", "colocated", "bf16")  # this project: defaults, each layout, bf16 engines
LAYOUT_FLAGS = {"split": ["--colocate", "False"], "colocated": ["--colocate", "True"],
                "bf16": ["--engine-dtype", "bfloat16"]}


# ---------------------------------------------------------------- the comlrl 1.4.3 virtualenv


def _probe(python: Path) -> dict | None:
    code = ("import json, importlib.metadata as m; import comlrl.trainers.reinforce; "
            "print(json.dumps({p: m.version(p) for p in ('comlrl', 'torch', 'transformers', "
            "'wandb', 'datasets')}))")
    try:
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                             timeout=300, cwd=tempfile.gettempdir())
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def ensure_comlrl_venv() -> dict:
    """Create (once) and check benchmarks/.venv-comlrl: comlrl 1.4.3 with our torch/transformers.

    Same torch and transformers as this project, so the comparison measures the trainers, not
    the kernels. PyPI's CUDA builds of torchvision/torchaudio break imports on CPU: removed.
    """
    import importlib.metadata as md

    python = COMLRL_VENV / "bin" / "python"
    versions = _probe(python) if python.exists() else None
    if versions and versions["comlrl"] == "1.4.3":
        return versions
    torch_v = md.version("torch").split("+")[0]
    tf_v = md.version("transformers")
    print(f"setting up {COMLRL_VENV} (comlrl==1.4.3, torch=={torch_v}, "
          f"transformers=={tf_v}); a few minutes, once", flush=True)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(COMLRL_VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run(pip + ["comlrl==1.4.3", f"torch=={torch_v}", f"transformers=={tf_v}"],
                   check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "--quiet", "-y", *UNINSTALL],
                   check=False, capture_output=True)
    versions = _probe(python)
    if not versions or versions["comlrl"] != "1.4.3":
        raise SystemExit(f"{COMLRL_VENV}: comlrl 1.4.3 does not import; delete the folder and "
                         f"run again")
    return versions


# ---------------------------------------------------------------- one side, one run


def run_side(side: str, model: Path, epochs: int, log_path: Path, checkpoint: bool,
             timeout: float, comlrl_threads: int | None = None, whole: bool = False) -> dict:
    """One run of seed_user_script.py; `whole`: the seed example as written (2 epochs with a
    checkpoint each, then a new trainer resumes to 4), timed as one process."""
    python = COMLRL_VENV / "bin" / "python" if side == "comlrl" else \
        bl.ROOT / ".venv" / "bin" / "python"
    with tempfile.TemporaryDirectory(prefix=f"bench-seed-{side}-") as tmp:
        tmp = Path(tmp)
        env = {**os.environ, **bl.BENCH_ENV, "WANDB_DIR": str(tmp)}
        env.pop("RAY_ADDRESS", None)
        # The user's script runs with the user's own allocator settings: our trainer gives
        # its actors ENGINE_ENV's (huge pages, glibc keeping freed memory) itself, and
        # comlrl sets none (until 2026-12-04 both sides ran with THP_MEM_ALLOC_ENABLE=1).
        for key in ("THP_MEM_ALLOC_ENABLE", "GLIBC_TUNABLES"):
            env.pop(key, None)
        if side == "comlrl" and comlrl_threads:
            # comlrl runs in one process; torch takes its thread count from OMP_NUM_THREADS.
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(comlrl_threads)
        cmd = [str(python), str(USER_SCRIPT), "--model", str(model), "--epochs", str(epochs),
               "--out", str(tmp / "times.json")] + LAYOUT_FLAGS.get(side, [])
        if checkpoint or whole:
            cmd += ["--checkpoint-dir", str(tmp / "checkpoints")]
        if whole:
            cmd[cmd.index("--epochs") + 1] = str(WHOLE_EPOCHS[0])
            cmd += ["--resume-epochs", str(WHOLE_EPOCHS[1])]
        start = time.time()
        with open(log_path, "w") as log:
            proc = subprocess.run(cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout)
        wall = time.time() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{side} run failed (exit {proc.returncode}); see {log_path}")
        times = json.loads((tmp / "times.json").read_text())
        rows = wandb_history(tmp)
    if whole:
        return analyse_whole(side, times, rows, wall, exited=start + wall)
    return analyse(side, times, rows, epochs, wall)


def analyse_whole(side: str, times: dict, rows: list[dict], wall: float,
                  exited: float) -> dict:
    """The whole seed example: the process, each train(), each train()'s first step, and the
    exit (from the script's last line to the process's end, `exited`)."""
    steps = sorted((r for r in rows if "turn_1/reward_mean" in r), key=lambda r: r["_step"])
    half = WHOLE_EPOCHS[0] * STEPS_PER_EPOCH
    if [r["_step"] for r in steps][-1:] != [WHOLE_EPOCHS[1] * STEPS_PER_EPOCH]:
        raise RuntimeError(f"{side}: the resumed half did not reach the last step")
    second = next(r for r in steps if r["_step"] > half)
    return {"side": side, "process_wall_s": wall,
            "first_train_s": times["trained"] - times["constructed"],
            "first_step_s": steps[0]["_timestamp"] - times["constructed"],
            "second_train_s": times["resumed"] - times["resume_start"],
            "second_first_step_s": second["_timestamp"] - times["resume_start"],
            "between_s": times["resume_start"] - times["trained"],
            "exit_s": exited - times["finished"]}


def print_whole(whole: dict) -> dict:
    """The whole-seed-example table; returns the medians and the ratios comlrl / ours."""
    keys = ("process_wall_s", "first_train_s", "first_step_s", "second_train_s",
            "second_first_step_s", "exit_s")
    rows, summary = [], {}
    for size, by_side in whole.items():
        # .get: results files written before the exit column have none (nan).
        summary[size] = {side: {k: bl.median([r.get(k, math.nan) for r in rs]) for k in keys}
                         for side, rs in by_side.items() if rs}
        for side, med in summary[size].items():
            rows.append([size, side] + [med[k] for k in keys] + [len(by_side[side])])
        for ours in OURS:
            if {ours, "comlrl"} <= set(summary[size]):
                o, c = summary[size][ours], summary[size]["comlrl"]
                summary[size][f"ratio_comlrl_over_{ours}"] = {k: c[k] / o[k] for k in keys}
                rows.append([size, f"ratio comlrl/{ours}"] + [c[k] / o[k] for k in keys] + [""])
    if rows:
        print(f"\n## The whole seed example as written, one process ({WHOLE_EPOCHS[0]} epochs, "
              f"then a new trainer resumes to {WHOLE_EPOCHS[1]})\n")
        print(bl.table(["model", "side", "process s", "1st train() s", "1st train() to "
                        "1st step s", "2nd train() s", "2nd train() to 1st step s", "exit s",
                        "runs"], rows))
    return summary


def analyse(side: str, times: dict, rows: list[dict], epochs: int, wall: float) -> dict:
    train_rows = sorted((r for r in rows if "turn_1/reward_mean" in r), key=lambda r: r["_step"])
    if not train_rows:
        raise RuntimeError(f"{side}: no training points in the W&B run")
    begin = times["models_loaded"]          # just before MAGRPOTrainer(...)
    by_epoch: dict[int, list[dict]] = {}
    for r in train_rows:
        by_epoch.setdefault(math.ceil(r["_step"] / STEPS_PER_EPOCH), []).append(r)
    if sorted(by_epoch) != list(range(1, epochs + 1)):
        raise RuntimeError(f"{side}: logged epochs {sorted(by_epoch)}, expected 1..{epochs}")
    ends = [max(r["_timestamp"] for r in by_epoch[e]) for e in range(1, epochs + 1)]
    epoch_s = [ends[0] - begin] + [b - a for a, b in zip(ends, ends[1:])]
    steady = bl.median(epoch_s[1:]) if epochs > 1 else None
    first = train_rows[0]
    out = {
        "side": side,
        "epoch_s": epoch_s,
        "steady_epoch_s": steady,
        "startup_s": (epoch_s[0] - steady) if steady is not None else None,
        "first_step_s": first["_timestamp"] - begin,
        "train_total_s": times["trained"] - begin,
        "process_wall_s": wall,
        "import_s": times["imported"] - times["process_start"],
        "final_reward_mean": train_rows[-1]["turn_1/reward_mean"],
    }
    if "timing/generation_s" in first:
        # Our per-step timers: where a steady epoch goes; the rest is reward, decoding, logging
        # and Ray round trips in the driver.
        keys = {"generation": "timing/generation_s", "learning": "timing/learning_s",
                "weight_sync": "timing/weight_sync_s"}
        steady_epochs = range(2, epochs + 1)
        for name, key in keys.items():
            out[f"{name}_per_epoch_s"] = bl.median(
                [sum(r.get(key, 0.0) for r in by_epoch[e]) for e in steady_epochs])
        if steady is not None:
            out["other_per_epoch_s"] = bl.median(
                [epoch_s[e - 1] - sum(r.get(k, 0.0) for r in by_epoch[e] for k in keys.values())
                 for e in steady_epochs])
        out["tokens_per_s"] = bl.median([r.get("throughput/generation_tokens_per_s")
                                         for e in steady_epochs for r in by_epoch[e]])
        step1 = sum(first.get(k, 0.0) for k in keys.values())
        # train() start to the first rollout: Ray, actors, engines, W&B init, fingerprints.
        out["ray_engines_startup_s"] = first["_timestamp"] - times["constructed"] - step1
        out["first_step_generation_s"] = first.get("timing/generation_s")
    return out


# ---------------------------------------------------------------- the floor


def measure_floor(sizes: list[str]) -> dict:
    """What this machine can do at best: matmul, memory copy, one learner-sized fwd+bwd."""
    import torch

    torch.set_num_threads(2)
    # Best of several short rounds, as a floor should be: one timed block of 5 copies read
    # 21 or 37 GB/s from one call to the next on the same idle VM (2026-12-04).
    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(4):
            a @ b
        rounds.append(time.perf_counter() - t)
    gflops = 2 * n ** 3 * 4 / min(rounds) / 1e9
    src = torch.ones(64 * 1024 * 1024)               # 256 MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    rounds = []
    for _ in range(8):
        t = time.perf_counter()
        dst.copy_(src)
        rounds.append(time.perf_counter() - t)
    copy_gbs = src.numel() * 4 / min(rounds) / 1e9
    del src, dst
    floor = {"threads": torch.get_num_threads(), "matmul_gflops": gflops,
             "copy_gbs": copy_gbs, "models": {}}
    for size in sizes:
        floor["models"][size] = fwd_bwd(bl.model_path(size), gflops, copy_gbs)
    return floor


def fwd_bwd(folder: Path, gflops: float, copy_gbs: float) -> dict:
    """One forward+backward over 16 sequences of 80 tokens (one update of both agents) and
    a rough per-epoch floor: 2 updates, plus decoding 2 agents x 2 chunks x 64 steps."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (16, 80), generator=g)
    times = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        logits = model(input_ids=ids, use_cache=False).logits
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])
        logp.sum().backward()
        times.append(time.perf_counter() - t)
    s = min(times[1:])
    tokens = ids.numel()
    decode_steps = 2 * 2 * 64                       # chunks x agents x tokens, batch of 8 each
    decode_bytes = decode_steps * params * 4        # each step reads the weights once
    decode_flops = 2 * params * PROMPTS * K * 64 * 2
    gen_floor = max(decode_bytes / (copy_gbs * 1e9), decode_flops / (gflops * 1e9))
    return {"params": params, "fwd_bwd_16x80_s": s,
            "fwd_bwd_gflops": 6 * params * tokens / s / 1e9,
            "epoch_floor_learning_s": 2 * s, "epoch_floor_generation_s": gen_floor,
            "epoch_floor_s": 2 * s + gen_floor}


def print_tables(runs: dict, sizes: list[str], sides: list[str], counts: dict,
                 epochs_of: dict) -> dict:
    """Print the comparison and our per-phase table; return the summary (medians, spreads)."""
    summary, rows = {}, []
    for size in sizes:
        summary[size] = {}
        for side in sides:
            rs = runs[size][side]
            agg = {}
            if not rs:
                continue
            for key in ("steady_epoch_s", "startup_s", "first_step_s", "train_total_s",
                        "process_wall_s", "generation_per_epoch_s", "learning_per_epoch_s",
                        "weight_sync_per_epoch_s", "other_per_epoch_s", "tokens_per_s",
                        "ray_engines_startup_s"):
                vals = [x.get(key) for x in rs if x.get(key) is not None]
                if vals:
                    agg[key] = {"median": bl.median(vals), "min": min(vals), "max": max(vals)}
            # Other processes only ever add time: the fastest steady epoch of all runs is the
            # best estimate of an undisturbed one on a busy machine.
            best = [min(x["epoch_s"][1:]) for x in rs if len(x["epoch_s"]) > 1]
            if best:
                agg["best_epoch_s"] = {"median": min(best), "min": min(best), "max": min(best)}
            summary[size][side] = agg
            med = lambda k: agg.get(k, {}).get("median")
            rng = lambda k: f"{bl.fmt(agg[k]['min'])}-{bl.fmt(agg[k]['max'])}" if k in agg else "-"
            busy = max(x["foreign_cpu"]["foreign_share"] for x in rs)
            agg["max_foreign_share"] = busy
            rows.append([size, f"{counts[size]:,}", side, med("startup_s"), med("first_step_s"),
                         med("steady_epoch_s"), rng("steady_epoch_s"), med("best_epoch_s"),
                         med("train_total_s"), f"{epochs_of[size]}x{len(rs)}",
                         f"{100 * busy:.0f}%"])
        for ours in OURS:
            if not (runs[size].get(ours) and runs[size].get("comlrl")):
                continue
            o, c = summary[size][ours], summary[size]["comlrl"]
            ratio = {k: c[k]["median"] / o[k]["median"]
                     for k in ("steady_epoch_s", "startup_s", "first_step_s", "train_total_s",
                               "best_epoch_s")
                     if k in o and k in c and o[k]["median"] and c[k]["median"] is not None}
            summary[size][f"ratio_comlrl_over_{ours}"] = ratio
            rows.append([size, "", f"ratio comlrl/{ours}", ratio.get("startup_s"),
                         ratio.get("first_step_s"), ratio.get("steady_epoch_s"), "",
                         ratio.get("best_epoch_s"), ratio.get("train_total_s"), "", ""])

    cols = ["model", "params", "side", "start-up s", "to 1st step s", "epoch s (steady)",
            "epoch spread", "best epoch s", "train() s", "epochs x runs", "other procs (max)"]
    print("\n## Seed example: this project vs comlrl 1.4.3\n")
    print(bl.table(cols, rows))
    prof_rows = []
    for size, ours in ((size, ours) for size in sizes for ours in OURS):
        o = summary[size].get(ours, {})
        if "steady_epoch_s" in o:
            m = lambda k: o.get(k, {}).get("median")
            prof_rows.append([size, ours, m("steady_epoch_s"), m("generation_per_epoch_s"),
                              m("learning_per_epoch_s"), m("weight_sync_per_epoch_s"),
                              m("other_per_epoch_s"), m("tokens_per_s"),
                              m("ray_engines_startup_s")])
    if prof_rows:
        print("\n## Our steady epoch, by phase (W&B timing/*, medians)\n")
        print(bl.table(["model", "side", "epoch s", "generation s", "learning s", "weight push s",
                        "other s", "gen tok/s", "Ray+engines start s"], prof_rows))
    return summary


# ---------------------------------------------------------------- main


def main() -> None:
    p = bl.size_parser(__doc__,
                       "smallest model, 1 repeat, 2 epochs (a quick check, under a minute)")
    p.add_argument("--repeats", type=int, default=3, help="runs per side (median, spread)")
    p.add_argument("--epochs", type=int, default=None,
                   help=f"epochs per run (default {DEFAULT_EPOCHS}); epoch 1 is warm-up")
    p.add_argument("--sides", default="ours,comlrl",
                   help="any of ours, split, colocated (ours with colocate=False/True), "
                        "bf16 (ours with engine_dtype='bfloat16'), comlrl")
    p.add_argument("--checkpoint", action="store_true",
                   help="checkpoint every epoch like the seed example (keep the newest)")
    p.add_argument("--no-floor", action="store_true", help="skip the floor measurements")
    p.add_argument("--whole-sizes", default=None,
                   help="sizes whose whole seed example (both halves, one process) is timed "
                        "too (default: every size; 'none' for none)")
    p.add_argument("--comlrl-threads", type=int, default=None,
                   help="OMP_NUM_THREADS for comlrl's process (default: torch's, = cores). 1 "
                        "keeps it usable on a busy machine, where 2 OpenMP threads stall")
    p.add_argument("--from-json", metavar="FILE",
                   help="print the tables of a results file (also a _partial one) and exit")
    a = p.parse_args()
    if a.from_json:
        d = json.loads(Path(a.from_json).read_text())
        st = d["settings"]
        print_tables(d["runs"], st["sizes"], st["sides"], st["params"], st["epochs"])
        print_whole(d.get("whole", {}))
        return
    sizes = bl.parse_sizes(a.sizes, a.short)
    repeats = 1 if a.short else a.repeats
    sides = [s.strip() for s in a.sides.split(",") if s.strip()]
    if set(sides) - {*OURS, "comlrl"}:
        p.error(f"--sides: unknown {sorted(set(sides) - {*OURS, 'comlrl'})}; use any of "
                f"{', '.join(OURS)}, comlrl")
    epochs_of = {s: a.epochs or (2 if a.short else DEFAULT_EPOCHS[s]) for s in sizes}

    load_start = os.getloadavg()
    versions = ensure_comlrl_venv() if "comlrl" in sides else None
    logs = bl.RESULTS_DIR / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    models = {s: bl.model_path(s) for s in sizes}
    counts = {s: bl.param_count(models[s]) for s in sizes}
    for s in sizes:
        print(f"model {s}: {counts[s]:,} parameters, {epochs_of[s]} epochs, {models[s]}",
              flush=True)
    with bl.ForeignCPU() as floor_monitor:
        floor = None if a.no_floor else measure_floor(sizes)
    if floor:
        floor["foreign_cpu"] = floor_monitor.report()

    name = bl.result_name("bench_seed", a.short, sizes, "ckpt" if a.checkpoint else "",
                          "-".join(sides) if sides != ["ours", "comlrl"] else "",
                          f"comlrl{a.comlrl_threads}t" if a.comlrl_threads else "")
    settings = {"sizes": sizes, "repeats": repeats, "epochs": epochs_of, "sides": sides,
                "checkpoint": a.checkpoint, "params": counts,
                "comlrl_threads": a.comlrl_threads}
    runs: dict[str, dict[str, list[dict]]] = {s: {side: [] for side in sides} for s in sizes}
    failures = []
    for size in sizes:
        for r in range(repeats):
            # Alternate which side goes first, so drift in the machine's load hits both.
            order = sides if r % 2 == 0 else list(reversed(sides))
            for side in order:
                timeout = 900 + 300 * epochs_of[size]
                try:
                    with bl.ForeignCPU() as monitor:
                        res = run_side(side, models[size], epochs_of[size],
                                       logs / f"seed-{size}-{side}-{r}.log", a.checkpoint,
                                       timeout, a.comlrl_threads)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    print(f"  {size} {side} run {r + 1}/{repeats} FAILED: {exc}", flush=True)
                    failures.append(f"{size} {side} run {r + 1}: {exc}")
                    continue
                res["foreign_cpu"] = monitor.report()
                runs[size][side].append(res)
                # Keep what is done so far, in case a later run dies.
                bl.write_results(name + "_partial", {"settings": settings, "floor": floor,
                                                     "runs": runs, "failures": failures})
                print(f"  {size} {side} run {r + 1}/{repeats}: steady epoch "
                      f"{bl.fmt(res['steady_epoch_s'])} s, start-up {bl.fmt(res['startup_s'])} s,"
                      f" train() {bl.fmt(res['train_total_s'])} s; other processes "
                      f"{100 * res['foreign_cpu']['foreign_share']:.0f}%", flush=True)

    whole_sizes = sizes if a.whole_sizes is None else \
        [x for x in a.whole_sizes.split(",") if x in sizes]
    whole: dict[str, dict[str, list[dict]]] = {s: {side: [] for side in sides}
                                               for s in whole_sizes}
    for size in whole_sizes:
        for r in range(repeats):
            for side in (sides if r % 2 == 0 else list(reversed(sides))):
                try:
                    res = run_side(side, models[size], 0, logs / f"whole-{size}-{side}-{r}.log",
                                   True, 900 + 600 * WHOLE_EPOCHS[1], a.comlrl_threads,
                                   whole=True)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    print(f"  whole {size} {side} run {r + 1} FAILED: {exc}", flush=True)
                    failures.append(f"whole {size} {side} run {r + 1}: {exc}")
                    continue
                whole[size][side].append(res)
                print(f"  whole seed example {size} {side} run {r + 1}/{repeats}: process "
                      f"{bl.fmt(res['process_wall_s'])} s, second train() first step "
                      f"{bl.fmt(res['second_first_step_s'])} s", flush=True)

    summary = print_tables(runs, sizes, sides, counts, epochs_of)
    summary["whole_seed_example"] = print_whole(whole)
    if floor:
        print(f"\n## Floor: matmul {floor['matmul_gflops']:.1f} GFLOP/s on "
              f"{floor['threads']} threads, memory copy {floor['copy_gbs']:.1f} GB/s\n")
        print(bl.table(["model", "params", "fwd+bwd 16x80 s", "GFLOP/s",
                        "epoch floor: learning s", "generation s", "total s"],
                       [[s, f"{f['params']:,}", f["fwd_bwd_16x80_s"], f["fwd_bwd_gflops"],
                         f["epoch_floor_learning_s"], f["epoch_floor_generation_s"],
                         f["epoch_floor_s"]] for s, f in floor["models"].items()]))
    path = bl.write_results(name, {
        "settings": settings, "comlrl_venv": versions, "floor": floor, "summary": summary,
        "runs": runs, "whole": whole, "failures": failures, "loadavg_at_start": load_start})
    (bl.RESULTS_DIR / f"{name}_partial.json").unlink(missing_ok=True)
    print(f"\nwrote {path}")
    if failures:
        raise SystemExit("failed runs:\n  " + "\n  ".join(failures))


if __name__ == "__main__":
    main()
