"""Chaos: one run's driver killed at eight moments and stopped like `ray job stop` once, resumed
after each; the run still logs every env_step exactly once with the straight run's value,
publishes only whole checkpoints (bit-identical to the straight run's), and touches no file
that is not its own.

Reference: the session's `straight` fixture (tests/conftest.py) (the seed example: 2 agents, 4 prompts,
K=4, 4 epochs, a checkpoint per epoch; env_steps 8, 16, ..., 64, 16 per epoch).

The victim is ONE run folder that goes through ten processes ("lives") of
tests/chaos_script.py, which is tests/seed_script.py with probe markers (and optional holds)
that compute nothing. A life starts fresh while the folder holds no checkpoint, and with
`--resume latest` once it does. Every life but the last is ended at one moment, by SIGKILL
to its whole process group (the driver, its local Ray and W&B's service) unless said
otherwise. Moments are found from the outside by polling files every 10 ms; "step s" below
is env_step s, and a life resumed from checkpoint-e trains steps 16e+8, 16e+16, ...:

 1. start-up: 2 s after launch, before Ray, W&B or any step (checked: no probe marker, no
    journal).
 2. just after a checkpoint appears: as soon as `checkpoint-1` is seen (a fresh life).
 3. start-up of a resume, during the push of the restored weights: CHAOS_HOLD=push:1 holds
    that push between agent 0's and agent 1's engines; killed on its marker, before W&B
    opens (checked: push-end-1 and gen-begin-1 never written).
 4. mid-generation: the life's first rollout round (the one for the first step after the
    checkpoint) is held by CHAOS_HOLD=gen:1 after its requests went out to the engines and
    before the driver collected them (a round is a fraction of a second here); killed on its
    marker; checked: that round never returned (no gen-end-1).
 5. during a weight push after an update: the push after step 32's update is held between
    the two agents (CHAOS_HOLD=push:k); checked: that push never ended.
 6. during a checkpoint write: `--pause-before-publish 4` holds the staged checkpoint-2
    (metadata.json written, not yet renamed); killed once `.staging-checkpoint-2/
    metadata.json` is seen; checked: checkpoint-2 was not there when the kill landed.
 7. `ray job stop`: SIGTERM to the whole process group as the rollouts of step 48 begin
    (checkpoint-2 published, step 40 sent), then SIGKILL 3 s later to whatever is left of
    the group, which is what `ray job stop` does to a job's driver.
 8. during a learner update: the update of step 56 is held after the learners were sent
    their batches and before their results are collected (CHAOS_HOLD=update:k).
 9. at the very end: as soon as `checkpoint-4` (the last) is seen, while the process is
    still finishing (pulling weights, finishing W&B, stopping Ray).
10. the final life resumes from checkpoint-4 and ends normally.

Each kill is asserted to have hit a live process: the driver had not exited before the
signal, and its exit status is the signal's (-9; for the stop 143, the SIGTERM handler's
exit, or -9). After each death the test waits until no process of the life's session is
left (Ray's actors run in their own process groups and exit once their raylet is gone) and
only then starts the next life, so no orphan writes into the folder while a new life starts;
a checkpoint published after the kill would still be caught by the watcher and the checks.

At the end: the W&B history read back from all offline folders of the run id holds every
env_step of the straight run exactly once with exactly the straight run's values (COMPARED);
checkpoint-1..4 verify their checksums, load with `from_pretrained` and hold the straight
run's weights; a `_Watcher` polling throughout saw no half checkpoint; no leftover is left
in the checkpoint dir; and files placed next to the checkpoint dir and in the W&B dir
(another tool's `checkpoint-1`, a `.staging-x` folder, notes) are byte-identical and
untouched (same mtime), with nothing added inside them.

Time: each life but the first pays a whole start-up (local Ray, two vLLM engines, two
learners: 30-60 s on the 2-core test machine) and dies within seconds of its first step, so
the test is ten process lives plus the reference run: 8.4-9.3 min measured on that
machine (load average 6-9, mostly the lives' own Ray and vLLM processes).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from comlrl.checkpoint import list_checkpoints, read_checkpoint_metadata, verify_checksums
from tests.conftest import ROOT, wandb_history
from tests.test_resume import (
    _by_step, _env, _journal_step, _same_weights, _seed_cmd, _Watcher,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHAOS_SCRIPT = ROOT / "tests" / "chaos_script.py"
EPOCHS = 4
STEPS_PER_EPOCH = 16          # 4 prompts x K=4, aligned single turn
STEPS_PER_UPDATE = 8          # rollout_buffer_size=2 prompts per update
LIFE_TIMEOUT_S = 240          # a moment not reached within this is a failure, not a wait


def _session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session `sid`: a life's driver started it."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            if os.getsid(pid) != sid:
                continue
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] != "Z":
            pids.append(pid)
    return pids


def _wandb_exit_code(folder: Path) -> int | None:
    """The exit code W&B recorded in an offline run folder; None if the run never finished."""
    exe = Path(sys.executable).parent / "wandb"
    for log in sorted(folder.glob("*.wandb")):
        shown = subprocess.run([str(exe) if exe.exists() else "wandb", "leet", "inspect",
                                "--json", str(log)], capture_output=True, text=True)
        for line in shown.stdout.splitlines():
            if line.startswith("{") and '"exit"' in line:
                entry = json.loads(line)
                if entry.get("type") == "exit":
                    return int(entry["exit"].get("exit_code", 0))
    return None


def _tree_snapshot(paths: list[Path]) -> dict[str, tuple[str, int]]:
    """sha256 and mtime of every file under `paths` (and the folders themselves)."""
    out: dict[str, tuple[str, int]] = {}
    for root in paths:
        for p in [root, *sorted(root.rglob("*"))] if root.is_dir() else [root]:
            if p.is_file():
                out[str(p)] = (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            else:
                out[str(p)] = ("dir", p.stat().st_mtime_ns)
    return out


class _Chain:
    """The victim run folder and its lives."""

    def __init__(self, model: str, base: Path):
        self.model, self.base = model, base
        self.run = base / "run"
        self.ckpt = self.run / "ckpt"
        self.wandb_dir = self.run / "wandb"
        self.env = _env(self.wandb_dir)
        self.lives: list[dict] = []
        self.wandb_folders: set[Path] = set()
        self.proc: subprocess.Popen | None = None
        self.life: dict = {}
        (base / "logs").mkdir(parents=True)

    # ---- a life

    def launch(self, moment: str, hold: str | None = None, pause: float | None = None) -> int:
        """Start the next life; returns the epoch of the checkpoint it resumes (0: fresh)."""
        n = len(self.lives) + 1
        found = list_checkpoints(self.ckpt)
        epoch = self.latest_epoch()
        self.probes = self.base / "probes" / f"life{n}"
        env = {**self.env, "CHAOS_PROBE_DIR": str(self.probes)}
        if hold:
            env["CHAOS_HOLD"] = hold
        cmd = _seed_cmd(self.model, self.ckpt, EPOCHS, "latest" if found else None)
        cmd[1] = str(CHAOS_SCRIPT)
        if pause:
            cmd += ["--pause-before-publish", str(pause)]
        self.log_path = self.base / "logs" / f"life{n}.log"
        self.life = {"life": n, "moment": moment, "resumed_from": found[-1].name if found
                     else None, "hold": hold}
        self.lives.append(self.life)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=log,
                                         stderr=subprocess.STDOUT, cwd=ROOT)
        self.started = time.monotonic()
        return epoch

    def latest_epoch(self) -> int:
        """Epochs in the newest checkpoint, the one `--resume latest` takes (0: none)."""
        found = list_checkpoints(self.ckpt)
        return int(read_checkpoint_metadata(found[-1])["epoch"]) if found else 0

    def marker(self, name: str) -> Path:
        return self.probes / name

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_for(self, what: str, cond, timeout: float = LIFE_TIMEOUT_S) -> None:
        """Poll `cond` every 10 ms while the life runs; fail if it ends or times out first."""
        deadline = time.monotonic() + timeout
        while not cond():
            if self.proc.poll() is not None:
                pytest.fail(f"life {self.life['life']} ({self.life['moment']}): the process "
                            f"ended (rc {self.proc.returncode}) before {what}.\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.end(signal.SIGKILL)
                pytest.fail(f"life {self.life['life']}: {what} not reached within {timeout} s."
                            f"\n{self.log_tail()}")
            time.sleep(0.01)

    def end(self, sig: int, grace_s: float = 0.0) -> int:
        """Signal the life's process group (SIGTERM, then SIGKILL after `grace_s`, like `ray
        job stop`); wait until no process of its session is left. Returns the exit status."""
        proc = self.proc
        assert proc.poll() is None, (f"life {self.life['life']}: the driver had already "
                                     f"exited (rc {proc.returncode}) before the signal")
        self.life.update(kill_at_s=round(time.monotonic() - self.started, 2),
                         signal=signal.Signals(sig).name,
                         journal_step=_journal_step(self.ckpt),
                         ckpt_at_kill=sorted(p.name for p in self.ckpt.glob("*checkpoint-*"))
                         if self.ckpt.exists() else [])
        os.killpg(proc.pid, sig)
        if grace_s:
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        rc = proc.wait(timeout=60)
        waited = time.monotonic()
        left = _session_pids(proc.pid)
        while left and time.monotonic() - waited < 30:
            time.sleep(0.1)
            left = _session_pids(proc.pid)
        for pid in left:  # still there after 30 s: ours, so ours to end
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.life.update(rc=rc, session_gone_after_s=round(time.monotonic() - waited, 2),
                         killed_leftovers=len(left),
                         ckpt_after=sorted(p.name for p in self.ckpt.glob("*checkpoint-*"))
                         if self.ckpt.exists() else [])
        self.note_wandb_folder()
        return rc

    def finish(self, timeout: float = 420) -> None:
        """The last life: it must end by itself, successfully."""
        rc = self.proc.wait(timeout=timeout)
        self.life.update(rc=rc, ran_s=round(time.monotonic() - self.started, 2))
        self.note_wandb_folder()
        assert rc == 0, self.log_tail(8000)
        # Ray's forwarded actor logs may follow the script's last line: read the whole log.
        done = f"DONE env_step={EPOCHS * STEPS_PER_EPOCH}"
        assert done in self.log_path.read_text(errors="replace"), self.log_tail()

    def note_wandb_folder(self) -> None:
        """The W&B folder this life opened (None: it died before W&B started) and whether
        W&B recorded an exit (its code) there."""
        folders = set((self.wandb_dir / "wandb").glob("offline-run-2*"))
        new = sorted(folders - self.wandb_folders)
        self.wandb_folders = folders
        self.life["wandb_folder"] = new[-1].name if new else None
        self.life["wandb_exit"] = _wandb_exit_code(new[-1]) if new else None

    def stop_all(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.end(signal.SIGKILL)


def _update_index(epoch: int, step: int) -> int:
    """Which update of a life resumed from checkpoint-`epoch` trains env_step `step`."""
    j = (step - epoch * STEPS_PER_EPOCH) // STEPS_PER_UPDATE
    assert j >= 1, f"step {step} is already in checkpoint-{epoch}: this moment cannot be reached"
    return j


def _place_foreign_files(run: Path, wandb_dir: Path) -> list[Path]:
    """Files that are not the run's, next to its checkpoint dir and in its W&B dir."""
    other = run / "other-tool" / "checkpoint-1"
    other.mkdir(parents=True)
    (other / "metadata.json").write_text('{"format": "not-comlrl", "epoch": 1}')
    (other / "weights.bin").write_bytes(os.urandom(4096))
    (run / "notes.txt").write_text("the user's notes, next to the checkpoint dir\n")
    inner = wandb_dir / "wandb"
    (inner / ".staging-x").mkdir(parents=True)
    (inner / ".staging-x" / "part.bin").write_bytes(os.urandom(1024))
    foreign_run = inner / "offline-run-20260101_000000-foreign0"
    foreign_run.mkdir()
    (foreign_run / "notes.txt").write_text("another run's folder\n")
    (wandb_dir / "keep.txt").write_text("kept\n")
    return [run / "other-tool", run / "notes.txt", inner / ".staging-x", foreign_run,
            wandb_dir / "keep.txt"]


def test_chaos_kills_and_stop_then_resume_match_straight_run(
        straight, tiny_model, tmp_path):
    began = time.monotonic()
    chain = _Chain(tiny_model, tmp_path)
    foreign = _place_foreign_files(chain.run, chain.wandb_dir)
    before = _tree_snapshot(foreign)
    chain.wandb_folders = set((chain.wandb_dir / "wandb").glob("offline-run-2*"))
    watcher = _Watcher(chain.ckpt)
    watcher.start()
    try:
        # 1. start-up, 2 s after launch
        chain.launch("start-up (2 s after launch)")
        time.sleep(2.0)
        assert chain.end(signal.SIGKILL) == -signal.SIGKILL
        assert not list(chain.probes.glob("*")) and _journal_step(chain.ckpt) == -1

        # 2. just after checkpoint-1 appears (fresh)
        assert chain.launch("just after checkpoint-1 appears") == 0
        chain.wait_for("checkpoint-1", lambda: (chain.ckpt / "checkpoint-1").is_dir())
        assert chain.end(signal.SIGKILL) == -signal.SIGKILL

        # 3. resume start-up: during the push of the restored weights
        chain.launch("resume start-up: push of the restored weights", hold="push:1")
        chain.wait_for("push-half-1", lambda: chain.marker("push-half-1").exists())
        assert chain.end(signal.SIGKILL) == -signal.SIGKILL
        assert not chain.marker("push-end-1").exists()
        assert not chain.marker("gen-begin-1").exists()

        # 4. mid-generation: the life's first rollout round, held while its requests are out
        chain.launch("mid-generation (first rollout round after the checkpoint)", hold="gen:1")
        chain.wait_for("gen-held-1", lambda: chain.marker("gen-held-1").exists())
        assert chain.end(signal.SIGKILL) == -signal.SIGKILL
        assert not chain.marker("gen-end-1").exists(), "the round ended before the kill"

        # 5. during the weight push after step 32's update
        push = _update_index(chain.latest_epoch(), 32) + 1  # push 1: the restore push
        chain.launch("weight push after step 32's update", hold=f"push:{push}")
        chain.wait_for(f"push-half-{push}", lambda: chain.marker(f"push-half-{push}").exists())
        assert chain.end(signal.SIGKILL) == -signal.SIGKILL
        assert not chain.marker(f"push-end-{push}").exists()

        # 6. during the write of checkpoint-2: staged and complete, not yet renamed
        staged = chain.ckpt / ".staging-checkpoint-2" / "metadata.json"
        chain.launch("checkpoint-2 staged, not yet published", pause=4.0)
        chain.wait_for(".staging-checkpoint-2/metadata.json", staged.exists)
        assert chain.end(signal.SIGKILL) == -signal.SIGKILL
        assert "checkpoint-2" not in chain.life["ckpt_at_kill"], chain.life

        # 7. `ray job stop`: SIGTERM to the group as step 48's rollouts begin, SIGKILL 3 s on
        gen = _update_index(chain.latest_epoch(), 48)
        chain.launch("ray job stop (SIGTERM, SIGKILL after 3 s) at step 48's rollouts")
        chain.wait_for(f"gen-begin-{gen}", lambda: chain.marker(f"gen-begin-{gen}").exists())
        rc = chain.end(signal.SIGTERM, grace_s=3.0)
        assert rc in (128 + signal.SIGTERM, -signal.SIGKILL), chain.life
        # The SIGTERM handler finished W&B as stopped, whether or not the rest of the
        # teardown (Ray's own processes got the SIGTERM too) ended within the 3 s.
        assert chain.life["wandb_exit"] == 128 + signal.SIGTERM, chain.life

        # 8. during the learner update of step 56
        update = _update_index(chain.latest_epoch(), 56)
        chain.launch("learner update of step 56", hold=f"update:{update}")
        chain.wait_for(f"update-held-{update}",
                       lambda: chain.marker(f"update-held-{update}").exists())
        assert chain.end(signal.SIGKILL) == -signal.SIGKILL
        assert not chain.marker(f"push-begin-{update + 1}").exists()

        # 9. at the very end: checkpoint-4 seen, the process still finishing
        chain.launch("very end: checkpoint-4 just published")
        chain.wait_for("checkpoint-4", lambda: (chain.ckpt / "checkpoint-4").is_dir())
        assert chain.end(signal.SIGKILL) == -signal.SIGKILL

        # 10. the last resume runs to the end
        chain.launch("final resume, runs to the end")
        chain.finish()
    finally:
        chain.stop_all()
        watcher.stop = True
        watcher.join()
        report = {"lives": chain.lives, "total_s": round(time.monotonic() - began, 1)}
        (tmp_path / "chaos-report.json").write_text(json.dumps(report, indent=1))
        print(json.dumps(report, indent=1))

    summary = json.dumps(chain.lives, indent=1)
    assert not watcher.problems, (watcher.problems, summary)
    names = [f"checkpoint-{n}" for n in range(1, EPOCHS + 1)]
    assert watcher.seen == set(names), (watcher.seen, summary)
    left = sorted(p.name for p in chain.ckpt.iterdir() if p.name != "wandb-journal.json.tmp")
    assert left == sorted(names + ["wandb-journal.json"]), (left, summary)

    # Every published checkpoint: whole, loadable, and the straight run's weights.
    from transformers import AutoModelForCausalLM

    ids = set()
    for n, name in enumerate(names, start=1):
        meta = read_checkpoint_metadata(chain.ckpt / name)
        verify_checksums(chain.ckpt / name, meta)
        assert meta["epoch"] == n and meta["env_step"] == n * STEPS_PER_EPOCH
        ids.add(meta["wandb"]["id"])
        AutoModelForCausalLM.from_pretrained(chain.ckpt / name / "agent_0")
        _same_weights(straight / "ckpt" / name, chain.ckpt / name)
    assert len(ids) == 1, f"checkpoints name several W&B runs: {ids}"
    run_id = ids.pop()

    # Every env_step exactly once (_by_step asserts it across all the run's folders), with
    # exactly the straight run's values.
    folders = sorted(p.name for p in (chain.wandb_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    got = _by_step(wandb_history(chain.wandb_dir, run_id))
    want = _by_step(wandb_history(straight / "wandb"))
    assert sorted(got) == sorted(want) == list(range(8, EPOCHS * STEPS_PER_EPOCH + 1, 8)), \
        (sorted(got), folders, summary)
    for step in want:
        assert got[step] == want[step], (step, got[step], want[step], summary)

    # Nothing that is not the run's was touched.
    assert _tree_snapshot(foreign) == before
