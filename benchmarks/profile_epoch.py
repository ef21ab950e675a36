"""Where our time goes: the seed run on this project's trainer, timed phase by phase.

Runs the seed config (as bench_seed.py does) in this process and wraps the driver's own
functions with timers, without changing them: every `ray_get` by its label (generation,
learning, weight push, checkpoint), the reward call, the rollout tree building, W&B logging,
checkpoint saves, and the start-up pieces (Ray, actors and engines, W&B). The workers'
replies give the time spent inside the engines (generate, vLLM reload), so what is left of
each wait is Ray and transfer overhead. Steady epochs (2..N) are reported, medians.

    python benchmarks/profile_epoch.py [--short] [--size 10M] [--epochs 4] [--no-checkpoint]
                                       [--checkpoint-interval 1]

With `--checkpoint-interval 3` (12 epochs or more) one run also measures what a checkpoint
costs: the epoch that ends with it (the save) and the one after (its write runs there),
against the clean epochs between them, in the same run. Pairs of whole runs with and
without checkpoints differ by as much as a checkpoint costs on these VMs (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

bl.apply_env()

STATE = {"epoch": -1}
EPOCHS: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
EPOCH_START: dict[int, float] = {}
STARTUP: dict[str, float] = defaultdict(float)
MARKS: dict[str, float] = {}
EPOCH_CPU: dict[int, dict[str, float]] = {}    # CPU s by process at each epoch's start


def add(key: str, seconds: float) -> None:
    if STATE["epoch"] == -1:
        STARTUP[key] += seconds
    elif STATE["epoch"] >= 0:
        EPOCHS[STATE["epoch"]][key] += seconds


def install_timers() -> None:
    import comlrl.rewards as rewards
    import comlrl.trainers.reinforce.magrpo as trainer_mod
    import workers.driver.actors as actors_mod
    import workers.driver.session as session_mod
    import workers.ray_calls as ray_calls
    from comlrl.wandb_run import WandbRun
    from workers.driver.session import Session

    def timed(owner, name, key, before=None):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if before:
                before(*args, **kwargs)
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                add(key, time.perf_counter() - t)

        setattr(owner, name, wrapper)

    real_ray_get = ray_calls.ray_get
    engine_seconds: list[float] = []          # per generate round: each worker's own seconds

    def ray_get(refs, what):
        # Labels as the driver writes them; matched loosely so that small changes to the
        # driver's wording do not silently drop a phase.
        t = time.perf_counter()
        out = real_ray_get(refs, what)
        dt = time.perf_counter() - t
        if "generating" in what:
            items = out if isinstance(out, list) else [out]
            engine_seconds.extend(r["seconds"] for r in items if isinstance(r, dict))
        elif "updating" in what:
            add("learning wait", dt)
        elif "starting rollout workers" in what:
            add("actors + engines start (wait)", dt)
        else:
            add(f"ray_get: {what}", dt)
        return out

    for module in list(sys.modules.values()):     # every driver module imported it by name
        if getattr(module, "ray_get", None) is real_ray_get:
            module.ray_get = ray_get

    real_generate = Session.generate

    def generate(self, *args, **kwargs):
        engine_seconds.clear()
        t = time.perf_counter()
        try:
            return real_generate(self, *args, **kwargs)
        finally:
            add("generation wait", time.perf_counter() - t)
            if engine_seconds:
                add("  inside engines (slowest worker)", max(engine_seconds))

    Session.generate = generate

    try:  # the reload seconds come back from update_weights through the transport's refs
        import ray
        from workers.transports.object_store import ColocatedTransport, ObjectStoreTransport

        pushed: list = []
        # An agent host's own engine loads in-process (`load_own_weights`), any further
        # worker of the agent through the object store: each push's refs, counted once.
        for cls in (ObjectStoreTransport, ColocatedTransport):
            def push(self, *args, _real=cls.__dict__["push"], _cls=cls, **kwargs):
                refs = _real(self, *args, **kwargs)
                if type(self) is _cls:
                    pushed.extend(refs)
                return refs

            cls.push = push
        real_push_weights = Session.push_weights

        def push_weights(self, *args, **kwargs):
            pushed.clear()
            out = real_push_weights(self, *args, **kwargs)
            secs = [x for x in ray.get(list(pushed)) if isinstance(x, float)] if pushed else []
            if secs:
                add("  vLLM reload inside workers (slowest)", max(secs))
            return out

        Session.push_weights = push_weights
    except (ImportError, AttributeError):
        pass

    def on_rollout(trainer, session, epoch, *a, **k):
        if STATE["epoch"] == -1:              # the first rollout: what start-up cost
            MARKS["cpu_at_first_rollout"] = cpu_by_process()
        if STATE["epoch"] != epoch:
            STATE["epoch"] = epoch
            EPOCH_START.setdefault(epoch, time.perf_counter())
            EPOCH_CPU.setdefault(epoch, cpu_by_process())

    timed(trainer_mod, "run_episode_batch", "rollout (driver total)", before=on_rollout)
    timed(rewards, "call_reward", "reward_func")
    timed(Session, "update_and_push", "update_and_push (driver total)")
    timed(Session, "push_weights", "weight push (driver total)")
    timed(Session, "log_step", "W&B log_step")
    timed(Session, "save_checkpoint", "checkpoint: save (learners write, commit queued)")
    timed(Session, "wait_checkpoint", "checkpoint: wait for commit")
    timed(Session, "pull_weights", "pull final weights")
    timed(session_mod, "ensure_ray", "ray.init")
    timed(actors_mod, "pack_model_folder", "pack model folders")
    timed(trainer_mod.MAGRPOTrainer, "fingerprints", "fingerprints")
    timed(WandbRun, "start", "wandb.init")
    timed(Session, "_start", "_start total")

    original_exit = Session.__exit__

    def exit_(self, *exc):
        MARKS["loop_end"] = time.perf_counter()
        MARKS["cpu_at_loop_end"] = cpu_by_process()
        STATE["epoch"] = -2
        t = time.perf_counter()
        try:
            return original_exit(self, *exc)
        finally:
            MARKS["teardown_s"] = time.perf_counter() - t

    Session.__exit__ = exit_


def cpu_by_process() -> dict[str, float]:
    """CPU seconds so far of this process ("driver") and each process it started, summed by
    kind: Ray actors by class ("ray::Learner", whichever method it runs now), other programs
    by file name."""
    tick = os.sysconf("SC_CLK_TCK")
    procs = bl.ForeignCPU._read()
    out: dict[str, float] = {}
    for pid in bl.ForeignCPU._mine(procs):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [w.decode(errors="replace") for w in argv if w]
        name = "driver" if pid == os.getpid() else next(
            (w.split()[0].split(".")[0] for w in words if w.startswith("ray::")),
            next((Path(w).name for w in words[1:] if w.endswith(".py")),
                 Path(words[0]).name if words else "?"))
        out[name] = out.get(name, 0.0) + procs[pid][1] / tick
    return out


def run(size: str, epochs: int, checkpoint: bool, interval: int = 1) -> dict:
    install_timers()
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
    from examples.rewards import length_ratio_reward

    model_name = str(bl.model_path(size))
    tokenizer = AutoTokenizer.from_pretrained(model_name)
    train_dataset = Dataset.from_dict({"prompt": [
        "Describe a city in the clouds:", "Invent a new holiday and explain it:",
        "Write a bedtime story for a dragon:", "Design a playground on Mars:"]})

    config = MAGRPOConfig(num_turns=1, num_train_epochs=epochs, num_generations=4,
                          max_new_tokens=64, logging_steps=1)
    trainer = MAGRPOTrainer(
        agents=[AutoModelForCausalLM.from_pretrained(model_name) for _ in range(2)],
        tokenizer=tokenizer, reward_func=length_ratio_reward, train_dataset=train_dataset,
        args=config, wandb_config={"project": "comlrl-bench", "name": "profile"})
    with tempfile.TemporaryDirectory(prefix="bench-profile-") as tmp:
        os.environ["WANDB_DIR"] = tmp
        cpu0 = cpu_by_process()
        t0 = time.perf_counter()
        if checkpoint:
            trainer.train(checkpoint_dir=str(Path(tmp) / "ckpt"), checkpoint_interval=interval,
                          checkpoint_total_limit=1)
        else:
            trainer.train()
        total = time.perf_counter() - t0
    starts = [EPOCH_START[e] for e in sorted(EPOCH_START)] + [MARKS["loop_end"]]
    walls = {e: b - a for e, a, b in zip(sorted(EPOCH_START), starts, starts[1:])}
    cpus = [EPOCH_CPU[e] for e in sorted(EPOCH_CPU)] + [MARKS["cpu_at_loop_end"]]
    epoch_cpu = {e: {k: b.get(k, 0.0) - a.get(k, 0.0) for k in b}
                 for e, a, b in zip(sorted(EPOCH_CPU), cpus, cpus[1:])}
    return {"size": size, "epochs": epochs, "checkpoint": checkpoint, "interval": interval,
            "train_s": total, "startup_s": starts[0] - t0, "teardown_s": MARKS["teardown_s"],
            "startup": dict(STARTUP), "epoch_wall_s": walls, "epoch_cpu_s": epoch_cpu,
            "startup_cpu_s": {k: v - cpu0.get(k, 0.0)
                              for k, v in MARKS["cpu_at_first_rollout"].items()},
            "per_epoch": {e: dict(v) for e, v in EPOCHS.items() if e >= 0}}


def summarise(res: dict) -> tuple[list[list], list[list]]:
    # Epoch 0 warms up; the last one also waits for the final checkpoint and pulls weights.
    ep = sorted(res["per_epoch"])
    steady = ep[1:-1] if len(ep) >= 3 else ep[-1:]
    med = lambda key: bl.median([res["per_epoch"][e].get(key, 0.0) for e in steady])
    wall = bl.median([res["epoch_wall_s"][e] for e in steady])
    g, rw, ro = (med("generation wait"), med("reward_func"), med("rollout (driver total)"))
    le, up = med("learning wait"), med("update_and_push (driver total)")
    pu = med("weight push (driver total)")
    lg = med("W&B log_step")
    ck = med("checkpoint: save (learners write, commit queued)") + \
        med("checkpoint: wait for commit")
    inside_gen = med("  inside engines (slowest worker)")
    reload_ = med("  vLLM reload inside workers (slowest)")
    rows = [
        ["generation: inside the vLLM engines", inside_gen],
        ["generation: Ray call + result transfer", g - inside_gen],
        ["reward (length ratio, whole lists)", rw],
        ["decode, tree, env_step (driver)", ro - g - rw],
        ["learning (learner actors, wait)", le],
        ["update: advantages, groups (driver)", up - le - pu],
        ["weight push: vLLM reload inside workers", reload_],
        ["weight push: export, object store, Ray calls", pu - reload_],
        ["W&B logging", lg],
        ["checkpoint (save + commit wait)", ck],
    ]
    accounted = sum(r[1] for r in rows)
    rows.append(["loop, tqdm, unaccounted", wall - accounted])
    rows = [[name, secs, f"{100 * secs / wall:.0f}%"] for name, secs in rows]
    rows.append(["epoch (steady, median)", wall, "100%"])
    st = res["startup"]
    last = res["per_epoch"][ep[-1]]
    start_rows = [
        ["ray.init (local, loopback)", st.get("ray.init", 0.0)],
        ["actors + engines start (wait)", st.get("actors + engines start (wait)", 0.0)],
        ["wandb.init", st.get("wandb.init", 0.0)],
        ["checkpointer start + clean (wait; the others start meanwhile)",
         st.get("ray_get: checkpointer", 0.0)],
        ["fingerprints (config, data, models)", st.get("fingerprints", 0.0)],
        ["pack model folders for the object store", st.get("pack model folders", 0.0)],
        ["models to disk, ray.put, actor launches, rest",
         st.get("_start total", 0.0) - sum(st.get(k, 0.0) for k in (
             "ray.init", "actors + engines start (wait)", "wandb.init", "ray_get: checkpointer",
             "fingerprints", "pack model folders"))],
        ["first rollout (engine warm-up included)", res["per_epoch"][0].get("generation wait")],
        ["the last epoch: wait for its checkpoint", last.get("checkpoint: wait for commit", 0.0)],
        ["the last epoch: final weights into the agents", last.get("pull final weights", 0.0)],
        ["teardown (finish W&B, kill actors)", res["teardown_s"]],
    ]
    start_rows.append(["train() start to first rollout", res["startup_s"]])
    return rows, start_rows


def checkpoint_cost_rows(res: dict) -> list[list]:
    """With a checkpoint every `interval` (>= 3) epochs: the epochs that end with one (its
    save), those right after (its write), and the clean ones, medians over the run's steady
    epochs; the cost of one checkpoint against a clean epoch, and each process's CPU in them
    (the cores are shared, so CPU spent anywhere can slow the epoch)."""
    interval, walls, cpu = res["interval"], res["epoch_wall_s"], res["epoch_cpu_s"]
    steady = sorted(walls)[1:-1]              # not the warm-up nor the last (final waits)
    kinds = {"clean": [e for e in steady if e % interval and (e + 1) % interval],
             "ends with a checkpoint": [e for e in steady if (e + 1) % interval == 0],
             "right after a checkpoint": [e for e in steady if e % interval == 0]}

    def medians(value) -> dict[str, float]:
        return {k: bl.median([value(e) for e in es]) if es else float("nan")
                for k, es in kinds.items()}

    def cost(m: dict[str, float]) -> float:
        return m["ends with a checkpoint"] + m["right after a checkpoint"] - 2 * m["clean"]

    med = medians(lambda e: walls[e])
    rows = [[k, len(es), med[k], " ".join(f"{walls[e]:.2f}" for e in es)]
            for k, es in kinds.items()]
    rows.append(["one checkpoint (both, less two clean)", "", cost(med),
                 f"{100 * cost(med) / med['clean']:+.1f}% of a clean epoch"])
    phases = res["per_epoch"]
    for name, key in (("generation inside the engines", "  inside engines (slowest worker)"),
                      ("learning (wait)", "learning wait")):
        m = medians(lambda e: phases[e].get(key, 0.0))
        rows.append([f"  {name}", "", m["clean"],
                     f"ends with {m['ends with a checkpoint']:.3f}, right after "
                     f"{m['right after a checkpoint']:.3f}: {cost(m):+.3f} per checkpoint"])
    for name in sorted({n for e in steady for n in cpu[e]}):
        m = medians(lambda e: cpu[e].get(name, 0.0))
        if max(m.values()) >= 0.005:
            rows.append([f"  CPU s of {name}", "", m["clean"],
                         f"ends with {m['ends with a checkpoint']:.3f}, right after "
                         f"{m['right after a checkpoint']:.3f}: {cost(m):+.3f} per checkpoint"])
    return rows


def cpu_rows(res: dict) -> list[list]:
    """CPU seconds each kind of process spent from train() start to the first rollout."""
    cpu = sorted(res["startup_cpu_s"].items(), key=lambda kv: -kv[1])
    rows = [[name, secs] for name, secs in cpu if secs >= 0.05]
    total = sum(secs for _, secs in cpu)
    rows.append(["all of them", total])
    rows.append([f"= wall seconds at {os.cpu_count()} busy cores", total / (os.cpu_count() or 1)])
    return rows


def ckpt_words(res: dict) -> str:
    if not res["checkpoint"]:
        return "no checkpoints"
    return "checkpoint every epoch" if res["interval"] == 1 else \
        f"a checkpoint every {res['interval']} epochs"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--short", action="store_true", help="0.43M, 2 epochs")
    p.add_argument("--size", default="10M", choices=list(bl.SIZES))
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--no-checkpoint", action="store_true",
                   help="do not checkpoint (the seed example checkpoints every epoch)")
    p.add_argument("--checkpoint-interval", type=int, default=1,
                   help="a checkpoint every N epochs; N >= 3 also prints what one costs")
    a = p.parse_args()
    size, epochs = ("0.43M", 2) if a.short else (a.size, a.epochs)
    with bl.ForeignCPU() as monitor:
        res = run(size, epochs, not a.no_checkpoint, a.checkpoint_interval)
    res["foreign_cpu"] = monitor.report()
    rows, start_rows = summarise(res)
    print(f"\n## Where the time goes in one steady epoch: {size}, seed config, "
          f"{ckpt_words(res)}\n")
    print(bl.table(["phase", "s per epoch", "share"], rows))
    if res["checkpoint"] and res["interval"] >= 3:
        print(f"\n## One checkpoint's cost in this run (a checkpoint every {res['interval']} "
              f"epochs)\n")
        print(bl.table(["epochs", "n", "median s", "each s"], checkpoint_cost_rows(res)))
    print("\n## Start-up and teardown\n")
    print(bl.table(["phase", "s"], start_rows))
    print("\n## CPU seconds by process, train() start to the first rollout\n")
    print(bl.table(["process", "CPU s"], cpu_rows(res)))
    name = bl.result_name("profile_epoch", a.short, [size] if not a.short else ["0.43M"],
                          "" if res["checkpoint"] else "nockpt",
                          f"every{res['interval']}" if res["interval"] > 1 else "")
    path = bl.write_results(name, {"result": res, "table": rows, "startup_table": start_rows})
    print("\n" + monitor.line())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
