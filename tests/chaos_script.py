"""tests/seed_script.py with probes, for the chaos test (tests/test_chaos.py).

    CHAOS_PROBE_DIR=D [CHAOS_HOLD=KIND:N] [CHAOS_HOLD_S=S] python tests/chaos_script.py ARGS

ARGS are seed_script.py's, and so is the training: the script is run unchanged (runpy). The
probes only create marker files and, where asked, wait; they compute nothing, so a run with
probes logs and saves the same values as one without. Markers in D, numbered per process
from 1 (push 1 of a resumed process is the one that gives the engines the restored weights):

    gen-begin-<n>, gen-end-<n>     around the n-th `Session.generate` (the engines' round)
    update-begin-<n>               the n-th `Session.update_and_push` starts
    push-begin-<n>, push-end-<n>   around the n-th `Session.push_weights`

CHAOS_HOLD=gen:N holds generation round N for S seconds after its requests went out to the
engines and before their results are collected (marker gen-held-N first).
CHAOS_HOLD=update:N holds update N for S seconds (default 3) after the learners were sent
their batches and before their results are collected (marker update-held-N first).
CHAOS_HOLD=push:N holds push N for S seconds after agent 0's weights were sent to its engines
and before agent 1's are (marker push-half-N first): a kill in that hold lands in the middle
of a weight push, agent 0's engines on the new weights and agent 1's on the old ones.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROBE_DIR = os.environ.get("CHAOS_PROBE_DIR")
HOLD_KIND, _, HOLD_N = (os.environ.get("CHAOS_HOLD") or ":0").partition(":")
HOLD_N = int(HOLD_N or 0)
HOLD_S = float(os.environ.get("CHAOS_HOLD_S") or 3.0)
_count = {"gen": 0, "update": 0, "push": 0}


def _mark(name: str) -> None:
    """Create PROBE_DIR/name in one rename, so a watcher never sees it half made."""
    tmp = Path(PROBE_DIR) / f".{name}.tmp"
    tmp.write_text(f"{time.time():.6f}")
    os.replace(tmp, Path(PROBE_DIR) / name)


def _hold(kind: str, n: int, marker: str) -> None:
    if HOLD_KIND == kind and HOLD_N == n:
        _mark(f"{marker}-{n}")
        time.sleep(HOLD_S)


def _install() -> None:
    from workers.driver import pool, session as session_module
    from workers.driver.session import Session

    generate, update_and_push = Session.generate, Session.update_and_push
    push_weights, ray_get = Session.push_weights, session_module.ray_get
    pool_ray_get = pool.ray_get

    def probed_generate(self, requests_per_agent, record):
        _count["gen"] += 1
        n = _count["gen"]
        _mark(f"gen-begin-{n}")
        out = generate(self, requests_per_agent, record)
        _mark(f"gen-end-{n}")
        return out

    def probed_update_and_push(self, *args, **kwargs):
        _count["update"] += 1
        _mark(f"update-begin-{_count['update']}")
        return update_and_push(self, *args, **kwargs)

    def probed_ray_get(refs, what):
        # Session.update_and_push calls its module's ray_get, so it gets this one.
        if what == "learners updating":
            _hold("update", _count["update"], "update-held")
        return ray_get(refs, what)

    def probed_pool_ray_get(refs, what):
        # RolloutPool collects each worker's part of a round through this name.
        if what.endswith(" generating"):
            _hold("gen", _count["gen"], "gen-held")
        return pool_ray_get(refs, what)

    def probed_push_weights(self):
        _count["push"] += 1
        n = _count["push"]
        _mark(f"push-begin-{n}")
        transport = self.pool.transport
        if HOLD_KIND == "push" and HOLD_N == n:
            plain = transport.push

            def held_push(agent, *args, **kwargs):
                if agent == 1:
                    _hold("push", n, "push-half")
                return plain(agent, *args, **kwargs)

            transport.push = held_push
            try:
                push_weights(self)
            finally:
                del transport.push
        else:
            push_weights(self)
        _mark(f"push-end-{n}")

    Session.generate = probed_generate
    Session.update_and_push = probed_update_and_push
    Session.push_weights = probed_push_weights
    session_module.ray_get = probed_ray_get
    pool.ray_get = probed_pool_ray_get


if PROBE_DIR:
    Path(PROBE_DIR).mkdir(parents=True, exist_ok=True)
    _install()
sys.argv = [str(ROOT / "tests" / "seed_script.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
