"""Shared pieces of the benchmark scripts: environment, model sizes, tables and JSON results.

Every benchmark imports this first: `apply_env()` must run before Ray, vLLM or W&B is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks run as scripts; `examples.*` lives at the root
    sys.path.insert(0, str(ROOT))
from examples.local_env import LOCAL_ENV  # noqa: E402

BENCH_DIR = ROOT / "benchmarks"
RESULTS_DIR = BENCH_DIR / "results"
MODELS_DIR = BENCH_DIR / ".models"

# Every benchmark process (and every process it starts) runs with these: the tests' local,
# offline environment (examples/local_env.py) plus a Ray temp dir of our own.
BENCH_ENV = {
    **LOCAL_ENV,
    # A Ray temp dir of our own: a plain ray.init() joins any cluster that `ray start` left
    # in /tmp/ray (its address file), and the trainer's local ray.init(num_cpus=...) then
    # fails with "When connecting to an existing cluster, num_cpus ... must not be provided".
    "RAY_TMPDIR": "/tmp/ray-bench",
}

# The model shapes: first the three of the issue. intermediate_size = 2 x hidden lands each parameter
# count on the number (0.43 M, ~10 M, 76.6 M); vocab 512, untied head.
SIZES = {
    "0.43M": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=256),
    "10M": dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4,
                intermediate_size=1024),
    "76.6M": dict(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=8,
                  intermediate_size=2048),
    # Larger shapes, only on request (--sizes): Qwen2.5-0.5B's layers, first with the small
    # untied vocabulary, then with its real one (151936 ids, head tied to the embedding:
    # 494 M parameters). tiny_model pads the tokenizer to the vocabulary with filler tokens.
    "358M": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                 intermediate_size=4864, vocab_size=512),
    "0.5B": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
}
# What a benchmark runs without --sizes: the three shapes.
DEFAULT_SIZES = ["0.43M", "10M", "76.6M"]


def apply_env() -> None:
    os.environ.update(BENCH_ENV)


def size_parser(doc: str, short_help: str) -> argparse.ArgumentParser:
    """A benchmark's command line, starting with the options they all have: --short (what it
    then runs is `short_help`) and --sizes (read with `parse_sizes`)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--short", action="store_true", help=short_help)
    p.add_argument("--sizes", help=f"comma list of {', '.join(SIZES)} (default: "
                   f"{','.join(DEFAULT_SIZES)})")
    return p


def parse_sizes(text: str | None, short: bool) -> list[str]:
    if short:
        return ["0.43M"]
    if not text:
        return list(DEFAULT_SIZES)
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in SIZES]
    if unknown:
        raise SystemExit(f"unknown size(s) {unknown}; choose from {', '.join(SIZES)}")
    return names


def model_path(size: str) -> Path:
    """The model folder of `size`, built once (seed 0) and reused by every benchmark."""
    shape = SIZES[size]
    name = f"{size}-h{shape['hidden_size']}-l{shape['num_layers']}-i{shape['intermediate_size']}"
    if "vocab_size" in shape or "tie_word_embeddings" in shape:
        # The three sizes keep their folder names (vocab 512, untied, implied).
        name += f"-v{shape.get('vocab_size', 512)}"
        name += "-tied" if shape.get("tie_word_embeddings") else "-untied"
    folder = MODELS_DIR / name
    if not (folder / "model.safetensors").exists():
        from comlrl.tiny_model import build_tiny_model

        build_tiny_model(folder, seed=0, **shape)
    return folder


def param_count(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            n = 1
            for d in f.get_slice(key).get_shape():
                n *= d
            total += n
    return total


def state_bytes(folder: Path) -> int:
    return (Path(folder) / "model.safetensors").stat().st_size


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def spread(xs):
    """(min, max) of the values, the spread reported next to each median."""
    xs = [x for x in xs if x is not None]
    return (min(xs), max(xs)) if xs else (None, None)


def fmt(x, digits=2) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, int):
        return str(x)
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if 0 < abs(x) < 0.1:
        return f"{x:.2g}" if digits <= 2 else f"{x:.{digits}g}"
    return f"{x:.{digits}f}"


def table(columns: list[str], rows: list[list]) -> str:
    """A Markdown table (readable on a terminal too)."""
    cells = [[fmt(c) if not isinstance(c, str) else c for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"
    out = [line(columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


def machine_info() -> dict:
    model = platform.processor() or ""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    info = {"cpu_model": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "loadavg_at_write": load,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.is_available()
    except ImportError:
        pass
    return info


def result_name(base: str, short: bool, sizes: list[str], *tags: str) -> str:
    """`base`, tagged when the run was not the full default one (so it keeps its own file)."""
    parts = [base]
    if short:
        parts.append("short")
    elif sizes != list(DEFAULT_SIZES):
        parts.append("-".join(sizes))
    parts += [t for t in tags if t]
    return "_".join(parts)


def write_results(name: str, payload: dict) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {"benchmark": name, "machine": machine_info(), "argv": sys.argv[1:],
               "loadavg_at_end": os.getloadavg(), **payload}
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


class ForeignCPU:
    """How busy other processes kept the machine while a benchmark ran.

    A thread samples /proc every `interval` s and adds up the CPU time of processes that are
    not this process or its descendants (Ray workers and subprocesses we started are ours).
    `share` = their CPU seconds / (wall seconds x cores): 0 on a quiet machine.
    """

    def __init__(self, interval: float = 1.0):
        import threading

        self.interval = interval
        self.foreign = self.own = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _read() -> dict:
        procs = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            # fields after the command: state ppid ... utime(12) stime(13) ... starttime(20)
            procs[int(entry.name)] = (int(rest[1]), int(rest[11]) + int(rest[12]), rest[19])
        return procs

    @staticmethod
    def _mine(procs: dict) -> set:
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in procs.items():
            children.setdefault(ppid, []).append(pid)
        mine, todo = set(), [os.getpid()]
        while todo:
            pid = todo.pop()
            mine.add(pid)
            todo += children.get(pid, [])
        return mine

    def _run(self) -> None:
        prev = self._read()
        while True:
            stopped = self._stop.wait(self.interval)
            cur = self._read()
            mine = self._mine(cur)
            for pid, (_, ticks, started) in cur.items():
                old = prev.get(pid)
                delta = ticks - old[1] if old and old[2] == started else 0
                if pid in mine:
                    self.own += delta / self._tick
                else:
                    self.foreign += delta / self._tick
            prev = cur
            if stopped:
                return

    def __enter__(self):
        self.start = time.time()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.wall = time.time() - self.start

    def report(self) -> dict:
        share = self.foreign / max(self.wall * (os.cpu_count() or 1), 1e-9)
        return {"foreign_cpu_s": self.foreign, "own_cpu_s": self.own, "wall_s": self.wall,
                "foreign_share": share, "quiet": share < 0.05}

    def line(self) -> str:
        r = self.report()
        return (f"other processes used {100 * r['foreign_share']:.0f}% of the machine's "
                f"{os.cpu_count()} cores during this run ({r['foreign_cpu_s']:.0f} CPU-s in "
                f"{r['wall_s']:.0f} s): {'quiet' if r['quiet'] else 'NOT quiet, timings noisy'}")


class Stopwatch:
    """`with Stopwatch() as sw: ...; sw.seconds`."""

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
