"""Peak memory of the whole seed example, per phase, this project against comlrl 1.4.3.

What runs: memory_user_script.py, the seed example as written (2 agents, 2 epochs with a
checkpoint each, then a new trainer resumes from the newest checkpoint to 4 epochs; K=4, 64 new
tokens: seed_user_script.py's --resume-epochs flow), once per (size, side), one after the
other, each in a fresh subprocess: `ours` with this project's .venv, `comlrl` with
benchmarks/.venv-comlrl (comlrl 1.4.3, bench_seed.ensure_comlrl_venv).

What is measured, every 0.2 s by a thread of this process while the run lasts:
  * machine used above idle: MemTotal - MemAvailable (/proc/meminfo) minus its value just
    before the subprocess started (after memory settled). It counts what the kernel cannot
    hand back: anonymous memory, shared memory (Ray's object store, tmpfs files), not the
    page cache. Other processes' changes count too: run it on a quiet machine.
  * used - others: the same less the change in every other process's Pss_Anon + Pss_Shmem
    since that moment (read every 1 s; this process's own left out), so that another program
    growing or ending meanwhile does not count (its tmpfs files and the kernel's own memory
    still do); bytes per parameter use this.
  * tree PSS: the sum over the subprocess and all its descendants (a local ray.init's GCS,
    raylet and every worker/actor) of Pss_Anon + Pss_Shmem (/proc/PID/smaps_rollup; else
    RssAnon + RssShmem from /proc/PID/status), so memory two processes share counts once.
Phases: the script appends "<time> <phase> start|end" lines to a log (see its docstring; ours:
start, generation, update, push, checkpoint, pull back inside construct/train/resume; comlrl:
construct, train, resume only). Each sample goes to the innermost phase active at its time
(the latest-started open one); samples outside every phase (imports, model loading, exit) are
"other". Background work (a checkpoint written while training goes on) counts in whatever
phase the driver is in then. Bytes per parameter = peak / (2 agents x parameters). The
summary's "others max change" (largest |change|) says how much the rest of the machine moved meanwhile.

A run is "OOM-killed" when it dies of signal 9 / exit 137 or its log names Ray's memory monitor
or an OutOfMemoryError; "refused" when our memory_check stopped it before it started.
Seconds per steady epoch: the median of epochs 2 and 4 (each the first of its train() pays the
start), from the W&B history's step timestamps as bench_seed.py reads them; from the script's
timestamps ((train + resume) / 4 epochs, starts included) where the history is unreadable.

    python benchmarks/bench_memory.py [--short] [--sizes 10M,76.6M,358M,0.5B]
                                      [--sides ours,comlrl] [--timeout 1500]
                                      [--setting FIELD=VALUE ...] [--lora FIELD=VALUE ...]

--setting adds a MAGRPOConfig field to our side's trainers (comlrl 1.4.3 has none of ours),
e.g. --setting gradient_checkpointing=True --setting "engine_dtype='bfloat16'". The side
"lora" is ours with LoRA agents (`peft_config=LoraConfig(...)`; comlrl 1.4.3 has no LoRA):
r=16 on every attention and MLP projection unless --lora fields say otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

bl.apply_env()

SCRIPT = bl.BENCH_DIR / "memory_user_script.py"
AGENTS = 2
EPOCHS = (2, 4)                        # train to 2 with a checkpoint each, resume to 4
STEPS_PER_EPOCH = 4 * 4                # 4 prompts x K=4 (env steps, one turn)
DEFAULT_SIZES = ["10M", "76.6M", "358M", "0.5B"]
SIDES = ("ours", "comlrl", "lora")
LORA_DEFAULTS = ("r=16", "lora_alpha=32", "target_modules=['q_proj', 'k_proj', 'v_proj', "
                 "'o_proj', 'gate_proj', 'up_proj', 'down_proj']")
INTERVAL = 0.2
OTHERS_EVERY = 5                       # other processes' PSS: every 5th sample (1 s)
GB = 1e9
OOM_TEXT = ("OutOfMemoryError", "killed by the memory monitor", "memory monitor killed")
REFUSED_TEXT = "MAGRPOConfig(memory_check=False) skips this estimate"


# ---------------------------------------------------------------- reading /proc


def used_bytes() -> int:
    """MemTotal - MemAvailable: memory in use that the kernel cannot hand out."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                info[key] = int(rest.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


def descendants(root: int, everyone: list[int] | None = None) -> list[int]:
    """`root` and every process below it (by parent pid, from /proc/PID/stat); `everyone`, when
    given, receives every pid seen."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
        if everyone is not None:
            everyone.append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def process_bytes(pid: int) -> int:
    """Pss_Anon + Pss_Shmem of one process; RssAnon + RssShmem where smaps_rollup is missing."""
    for path, keys in ((f"/proc/{pid}/smaps_rollup", ("Pss_Anon:", "Pss_Shmem:")),
                       (f"/proc/{pid}/status", ("RssAnon:", "RssShmem:"))):
        try:
            with open(path) as f:
                found = [int(line.split()[1]) * 1024 for line in f if line.startswith(keys)]
        except OSError:
            continue
        if found:
            return sum(found)
    return 0


def process_name(pid: int) -> str:
    """A process's command line, cut to 60 characters (Ray's actors show their title)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().replace(b"\0", b" ").decode(errors="replace").split()
    except OSError:
        return "?"
    return " ".join(w.rsplit("/", 1)[-1] if i == 0 else w for i, w in enumerate(words))[:60]


def others_bytes(exclude: set[int], everyone: list[int] | None = None) -> int:
    """Pss_Anon + Pss_Shmem of every process but `exclude` (the run's): what the rest of the
    machine holds, to tell its changes from the run's in the machine-wide number."""
    if everyone is None:
        everyone = []
        descendants(-1, everyone)
    return sum(process_bytes(p) for p in everyone if p not in exclude)


def settle(seconds: float = 30.0) -> int:
    """Wait (at most `seconds`) until memory in use stops falling after the previous run, and
    return it: the idle level the next run is measured above."""
    last = used_bytes()
    deadline = time.time() + seconds
    while time.time() < deadline:
        time.sleep(1.0)
        now = used_bytes()
        if abs(now - last) < 32 * 1024 * 1024:
            return now
        last = now
    return used_bytes()


class Sampler(threading.Thread):
    """Every INTERVAL s while `proc` runs: (time, used above `idle`, tree PSS, processes,
    other processes' PSS above `others_idle`, read every OTHERS_EVERY-th sample)."""

    def __init__(self, proc: subprocess.Popen, idle: int, others_idle: int):
        super().__init__(daemon=True)
        self.proc, self.idle, self.others_idle = proc, idle, others_idle
        self.samples: list[tuple[float, int, int, int, int]] = []
        self.peaks: dict[int, tuple[int, str]] = {}
        """Each process's peak Pss_Anon + Pss_Shmem, and its name then (Ray's process title
        names the actor and its method): which process holds what."""

    def run(self) -> None:
        others = self.others_idle
        while self.proc.poll() is None:
            t = time.time()
            everyone: list[int] = []
            pids = descendants(self.proc.pid, everyone)
            each = {p: process_bytes(p) for p in pids}
            pss = sum(each.values())
            for p, b in each.items():
                if b > self.peaks.get(p, (-1, ""))[0]:
                    self.peaks[p] = (b, process_name(p))
            if len(self.samples) % OTHERS_EVERY == 0:
                others = others_bytes(set(pids) | {os.getpid()}, everyone)
            self.samples.append((t, used_bytes() - self.idle, pss, len(pids),
                                 others - self.others_idle))
            time.sleep(max(0.0, INTERVAL - (time.time() - t)))


# ---------------------------------------------------------------- phases


def read_spans(log: Path, end: float) -> list[tuple[str, float, float]]:
    """(phase, start, end) from the script's phase log; a phase still open when the process
    ended closes at `end`. Nested phases of one name (construct inside resume) pair up LIFO."""
    spans, open_at = [], {}
    if not log.exists():
        return spans
    for line in log.read_text().splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue                            # a line cut short by a kill
        t, name, edge = float(parts[0]), " ".join(parts[1:-1]), parts[-1]
        if edge == "start":
            open_at.setdefault(name, []).append(t)
        elif edge == "end" and open_at.get(name):
            spans.append((name, open_at[name].pop(), t))
    spans += [(name, t, end) for name, starts in open_at.items() for t in starts]
    return sorted(spans, key=lambda s: s[1])


def innermost(spans: list[tuple[str, float, float]], t: float) -> str:
    active = [s for s in spans if s[1] <= t <= s[2]]
    if not active:
        return "other"
    return max(active, key=lambda s: (s[1], -s[2]))[0]


def per_phase(samples: list, spans: list) -> dict[str, dict]:
    """Per phase: the peaks of the samples it was the innermost phase of (None: it never was,
    each of its calls shorter than the sampling interval), their count, the most processes,
    and its seconds (all its calls, nested phases included)."""
    out: dict[str, dict] = {}
    blank = lambda: {"used": None, "net": None, "pss": None, "samples": 0, "procs": None,
                     "seconds": None}
    for name, start, end in spans:
        p = out.setdefault(name, blank())
        p["seconds"] = (p["seconds"] or 0.0) + (end - start)
    for t, used, pss, procs, others in samples:
        p = out.setdefault(innermost(spans, t), blank())
        p["used"], p["pss"] = max(p["used"] or 0, used), max(p["pss"] or 0, pss)
        p["net"] = max(p.get("net") or 0, used - others)
        p["samples"] += 1
        p["procs"] = max(p["procs"] or 0, procs)
    return out


# ---------------------------------------------------------------- epochs


def steady_epoch_seconds(wandb_dir: Path, times: dict) -> tuple[float | None, str]:
    """Median of epochs 2 and 4 from the W&B steps' timestamps; else (train + resume) / 4."""
    try:
        from examples.training_curve import wandb_history

        rows = [r for r in wandb_history(wandb_dir)
                if "_timestamp" in r and "_step" in r and "turn_1/reward_mean" in r]
        ends = {}
        for k in range(1, EPOCHS[1] + 1):
            inside = [r["_timestamp"] for r in rows if r["_step"] <= k * STEPS_PER_EPOCH]
            if inside and any(r["_step"] > (k - 1) * STEPS_PER_EPOCH for r in rows):
                ends[k] = max(inside)
        steady = [ends[k] - ends[k - 1] for k in (2, 4) if k in ends and k - 1 in ends]
        if steady:
            return bl.median(steady), "W&B steps (epochs 2, 4)"
    except Exception as exc:  # noqa: BLE001 - the history is a nicety; fall back below
        print(f"  (W&B history unreadable: {type(exc).__name__}: {exc})", flush=True)
    if times.get("resumed"):
        train_s = (times["trained"] - times["constructed"]) + \
            (times["resumed"] - times["resume_start"])
        return train_s / EPOCHS[1], "train() time / 4 (starts included)"
    return None, "-"


# ---------------------------------------------------------------- one run


def python_of(side: str) -> Path:
    if side == "comlrl":
        return bl.BENCH_DIR / ".venv-comlrl" / "bin" / "python"
    return bl.ROOT / ".venv" / "bin" / "python"


def outcome_of(code: int | None, timed_out: bool, text: str) -> str:
    if timed_out:
        return f"timed out (killed, exit {code})"
    if code == 0:
        return "completed"
    if code in (-signal.SIGKILL, 137) or any(s in text for s in OOM_TEXT):
        return f"OOM-killed (exit {code})"
    if REFUSED_TEXT in text:
        return f"refused by memory_check (exit {code})"
    return f"failed (exit {code})"


def run_one(size: str, side: str, model: Path, params: int, timeout: float,
            log_path: Path, settings: list[str] = (), lora: list[str] = ()) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-memory-{side}-") as tmp:
        tmp = Path(tmp)
        env = {**os.environ, **bl.BENCH_ENV, "WANDB_DIR": str(tmp)}
        # The user's own environment, as bench_seed.py runs it: no cluster to join, no
        # allocator settings (our trainer gives its actors theirs itself).
        for key in ("RAY_ADDRESS", "THP_MEM_ALLOC_ENABLE", "GLIBC_TUNABLES"):
            env.pop(key, None)
        phase_log = tmp / "phases.log"
        cmd = [str(python_of(side)), str(SCRIPT), "--model", str(model),
               "--phase-log", str(phase_log), "--out", str(tmp / "times.json"),
               "--checkpoint-dir", str(tmp / "checkpoints"),
               "--epochs", str(EPOCHS[0]), "--resume-epochs", str(EPOCHS[1]),
               "--agents", str(AGENTS)]
        if side in ("ours", "lora"):
            cmd += [arg for item in settings for arg in ("--setting", item)]
        if side == "lora":
            cmd += [arg for item in lora for arg in ("--lora", item)]
        idle = settle()
        others_idle = others_bytes({os.getpid()})
        start = time.time()
        timed_out = False
        with open(log_path, "w") as log:
            # Its own process group: a timeout (or a dead driver's leftovers) is cleaned up
            # by group, and only this run's processes are in it.
            proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            sampler = Sampler(proc, idle, others_idle)
            sampler.start()
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
            sampler.join()
        end = time.time()
        try:
            os.killpg(proc.pid, signal.SIGKILL)     # anything of the run still alive
        except ProcessLookupError:
            pass
        text = log_path.read_text(errors="replace")
        spans = read_spans(phase_log, end)
        times = json.loads((tmp / "times.json").read_text()) if code == 0 else {}
        epoch_s, epoch_from = steady_epoch_seconds(tmp, times) if code == 0 else (None, "-")
    samples = sampler.samples
    return {
        "size": size, "side": side, "params": params, "outcome": outcome_of(code, timed_out,
                                                                             text),
        "exit_code": code, "wall_s": end - start, "idle_used_bytes": idle,
        "peak_used_bytes": max((s[1] for s in samples), default=None),
        "peak_pss_bytes": max((s[2] for s in samples), default=None),
        "peak_net_bytes": max((s[1] - s[4] for s in samples), default=None),
        "others_max_change_bytes": max((abs(s[4]) for s in samples), default=None),
        "steady_epoch_s": epoch_s, "steady_epoch_from": epoch_from,
        "phases": per_phase(samples, spans),
        "traced_methods": times.get("traced_methods"),
        "spans": [(n, a - start, b - start) for n, a, b in spans],
        "samples": [(round(t - start, 2), *rest) for t, *rest in samples],
        "process_peaks": sorted(([name, b] for b, name in sampler.peaks.values()),
                                key=lambda x: -x[1]),
        "log": str(log_path),
    }


# ---------------------------------------------------------------- tables


PHASE_ORDER = ("load models", "construct", "start", "generation", "update", "push",
               "checkpoint", "pull back", "train", "resume", "other")


def gb(x: int | None) -> float | None:
    return None if x is None else x / GB


def per_byte(x: int | None, params: int) -> float | None:
    return None if x is None else x / (AGENTS * params)


def phase_table(run: dict) -> str:
    names = sorted(run["phases"], key=lambda n: (PHASE_ORDER.index(n)
                                                 if n in PHASE_ORDER else 99, n))
    rows = []
    for name in names:
        p = run["phases"][name]
        rows.append([name, gb(p["used"]), gb(p.get("net")), per_byte(p.get("net"), run["params"]),
                     gb(p["pss"]), per_byte(p["pss"], run["params"]), p["seconds"],
                     p["samples"], p["procs"]])
    return bl.table(["phase (innermost)", "used GB", "used-others GB", "B/param",
                     "tree PSS GB", "PSS B/param", "phase s (all calls)", "samples",
                     "processes"], rows)


def process_table(run: dict, top: int = 10) -> str:
    """The processes that held the most at their own peaks (these need not coincide)."""
    rows = [[name, gb(b), per_byte(b, run["params"])]
            for name, b in run.get("process_peaks", [])[:top]]
    return bl.table(["process (at its peak)", "Pss_Anon+Shmem GB", "B/param"], rows)


def summary_table(runs: list[dict]) -> str:
    rows = [[r["size"], f"{r['params']:,}", r["side"], r["outcome"], gb(r["peak_used_bytes"]),
             gb(r.get("peak_net_bytes")), per_byte(r.get("peak_net_bytes"), r["params"]),
             gb(r["peak_pss_bytes"]), per_byte(r["peak_pss_bytes"], r["params"]),
             gb(r.get("others_max_change_bytes")), r["steady_epoch_s"], r["wall_s"]]
            for r in runs]
    return bl.table(["size", "params", "side", "outcome", "peak used GB", "used-others GB",
                     "B/param", "peak PSS GB", "PSS B/param", "others max change GB",
                     "s/steady epoch", "wall s"], rows)


# ---------------------------------------------------------------- main


def main() -> None:
    global AGENTS
    p = bl.size_parser(__doc__, "0.43M, ours only (a quick check, about a minute)")
    p.add_argument("--sides", default="ours,comlrl", help="any of ours, comlrl")
    p.add_argument("--timeout", type=float, default=1500, help="seconds per run")
    p.add_argument("--from-json", metavar="FILE", help="print a results file's tables and exit")
    p.add_argument("--setting", action="append", default=[], metavar="FIELD=VALUE",
                   help="a MAGRPOConfig field for our side (a Python literal); repeatable")
    p.add_argument("--agents", type=int, default=AGENTS, choices=(1, 2, 3, 4),
                   help="agents per run (the seed example's 2; B/param divides by them)")
    p.add_argument("--lora", action="append", default=[], metavar="FIELD=VALUE",
                   help="a LoraConfig field for the lora side (over LORA_DEFAULTS)")
    a = p.parse_args()
    AGENTS = a.agents
    if a.from_json:
        runs = json.loads(Path(a.from_json).read_text())["runs"]
        for r in runs:              # the phases again from the stored samples and spans
            samples = [(*x, 0)[:5] for x in r["samples"]]   # files before `others`: 0
            r["phases"] = per_phase(samples, [tuple(s) for s in r["spans"]])
            print(f"\n## {r['size']} {r['side']}: {r['outcome']}\n\n{phase_table(r)}")
        print(f"\n## Summary\n\n{summary_table(runs)}")
        return
    if a.short:
        sizes, sides = ["0.43M"], ["ours"]
    else:
        sizes = bl.parse_sizes(a.sizes or ",".join(DEFAULT_SIZES), False)
        sides = [s.strip() for s in a.sides.split(",") if s.strip()]
    if set(sides) - set(SIDES):
        p.error(f"--sides: unknown {sorted(set(sides) - set(SIDES))}; use any of "
                f"{', '.join(SIDES)}")
    versions = None
    if "comlrl" in sides:
        import bench_seed

        versions = bench_seed.ensure_comlrl_venv()
    logs = bl.RESULTS_DIR / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    models = {s: bl.model_path(s) for s in sizes}
    params = {s: bl.param_count(models[s]) for s in sizes}
    tags = ["short" if a.short else "-".join(sizes) if sizes != DEFAULT_SIZES else "",
            "-".join(sides) if sides != list(SIDES) and not a.short else "",
            "-".join(x.split("=")[0] for x in a.setting),
            f"{AGENTS}agents" if AGENTS != 2 else ""]
    name = "_".join(["bench_memory", *(t for t in tags if t)])
    settings = {"sizes": sizes, "sides": sides, "params": params, "epochs": EPOCHS,
                "agents": AGENTS, "interval_s": INTERVAL, "timeout_s": a.timeout,
                "our_settings": a.setting, "lora": [*LORA_DEFAULTS, *a.lora]}
    runs: list[dict] = []
    for size in sizes:
        for side in sides:
            print(f"{size} ({params[size]:,} parameters) {side}: running", flush=True)
            with bl.ForeignCPU() as monitor:
                run = run_one(size, side, models[size], params[size], a.timeout,
                              logs / f"memory-{size}-{side}.log", a.setting,
                              [*LORA_DEFAULTS, *a.lora])
            run["foreign_cpu"] = monitor.report()
            runs.append(run)
            print(f"\n## {size} {side}: {run['outcome']}, {run['wall_s']:.0f} s; "
                  f"{AGENTS} x {params[size] / 1e6:.2f}M parameters; {monitor.line()}\n")
            print(phase_table(run), flush=True)
            print(f"\n{process_table(run)}", flush=True)
            bl.write_results(name + "_partial", {"settings": settings, "comlrl_venv": versions,
                                                 "runs": runs})
    print(f"\n## Summary (peaks over the whole run; B/param = peak / ({AGENTS} agents x "
          f"params))\n")
    print(summary_table(runs))
    path = bl.write_results(name, {"settings": settings, "comlrl_venv": versions,
                                   "runs": runs})
    (bl.RESULTS_DIR / f"{name}_partial.json").unlink(missing_ok=True)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
