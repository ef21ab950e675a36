"""What one checkpoint costs, piece by piece, against the floor of writing its bytes once.

For each size, one agent's real checkpoint on an otherwise idle machine: a `Learner` (the
plain class, no Ray) takes one update so that AdamW holds its moments, then
  - `save` (the snapshot the training waits for) and `saved` (the background write),
  - `commit_checkpoint` (the hash of the files the write did not hash on the way, fsync,
    rename: the checkpointer's part),
against the same number of bytes written once from one memory buffer to new files in the same
folder with ordinary writes, no copy, no hash, no fsync (the floor of a buffered write; the
optimizer file, written past the page cache (`workers.checkpoint_write`), can beat it). Each
part is timed as wall and CPU seconds of this process (the write thread included). On 2 busy
cores a checkpoint's CPU seconds are roughly what it adds to an epoch.

    python benchmarks/bench_checkpoint.py [--short] [--sizes 10M,76.6M] [--agents 2]
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

bl.apply_env()


def timed(fn):
    """(result, wall s, CPU s of this process) of fn()."""
    cpu, wall = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def write_floor(folder: Path, buf: memoryview, parts: int) -> None:
    """`buf` written into `parts` new files: the checkpoint's bytes, once, nothing else."""
    folder.mkdir()
    for i in range(parts):
        with open(folder / f"part{i}", "wb") as f:
            f.write(buf)


def one_size(size: str, agents: int, root: Path) -> dict:
    from comlrl.checkpoint import begin_staging, commit_checkpoint
    from workers.roles.learner import Learner

    folder = bl.model_path(size)
    learner = Learner(0, str(folder), learning_rate=1e-5, train_batch_size=2, threads=1)
    group = {"prompt_ids": [1, 2, 3], "completions": [[4, 5, 6], [7, 8]],
             "returns": [1.0, 0.0], "turn": 0}
    learner.update([group], shuffle_seed=0)
    ckpt_dir = root / f"ckpt-{size}"
    staging = begin_staging(ckpt_dir, 1, "bench")
    rows = {"save (snapshot)": [0.0, 0.0], "write (background thread)": [0.0, 0.0]}
    digests = {}              # what the writes hashed on the way (`Checkpointer.commit`)
    for a in range(agents):   # one learner saves every agent's folder: same bytes, in turn
        _, wall, cpu = timed(lambda: learner.save(str(staging / f"agent_{a}")))
        rows["save (snapshot)"][0] += wall
        rows["save (snapshot)"][1] += cpu
        files, wall, cpu = timed(learner.saved)
        digests.update({f"agent_{a}/{name}": d for name, d in files.items() if d})
        rows["write (background thread)"][0] += wall
        rows["write (background thread)"][1] += cpu
    nbytes = sum(f.stat().st_size for f in staging.rglob("*") if f.is_file())
    meta = {"env_step": 0, "epoch": 1, "run_uid": "bench"}
    _, wall, cpu = timed(lambda: commit_checkpoint(staging, meta, digests=digests))
    rows["commit (hash of the rest, fsync, rename)"] = [wall, cpu]
    parts = 2 * agents                 # weights and optimizer state of each agent
    buf = memoryview(bytearray(os.urandom(1 << 20)) * max(1, nbytes // parts // (1 << 20)))
    _, wall, cpu = timed(lambda: write_floor(root / f"floor-{size}", buf, parts))
    floor = [wall, cpu]
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    shutil.rmtree(root / f"floor-{size}", ignore_errors=True)
    total = [sum(v[i] for v in rows.values()) for i in (0, 1)]
    return {"size": size, "bytes": nbytes, "parts": rows, "ours": total, "floor": floor}


def main() -> None:
    p = bl.size_parser(__doc__, "10M only")
    p.add_argument("--agents", type=int, default=2)
    args = p.parse_args()
    sizes = ["10M"] if args.short else bl.parse_sizes(args.sizes or "10M,76.6M", False)
    results = []
    with bl.ForeignCPU() as watch, \
            tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        for size in sizes:
            results.append(one_size(size, args.agents, Path(tmp)))
    rows = []
    for r in results:
        for name, (wall, cpu) in r["parts"].items():
            rows.append([r["size"], f"{r['bytes'] / 1e6:,.0f} MB", name, wall, cpu])
        rows.append([r["size"], "", "**ours, all parts**", *r["ours"]])
        rows.append([r["size"], "", "the bytes written once, ordinary writes", *r["floor"]])
    print(f"\n## One checkpoint of {args.agents} agents, idle machine\n")
    print(bl.table(["model", "bytes", "part", "wall s", "CPU s"], rows))
    print(f"\n{watch.line()}")
    name = bl.result_name("bench_checkpoint", args.short, sizes)
    print(f"wrote {bl.write_results(name, {'results': results, 'foreign_cpu': watch.report()})}")


if __name__ == "__main__":
    main()
