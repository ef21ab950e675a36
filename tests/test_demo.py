"""The README's first command: examples/resume_demo.py, run once as a user runs it.

The session's one demo run (`demo_run`, tests/conftest.py) serves every test here and the
resume tests of tests/test_resume.py.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_demo_exits_zero_with_a_short_console_a_summary_and_actor_logs(demo_run):
    """At default verbosity the console is a header, one progress bar and a closing summary
    per train() (lines as a terminal shows them: a bar redraws in place); everything the
    actors print goes to one log file per actor."""
    assert demo_run.proc.returncode == 0, demo_run.output[-6000:]
    shown = [line for line in demo_run.output.split("\n") if line.strip()]
    assert len(shown) < 40, "\n".join(shown)
    out = demo_run.output
    # The resume's train() takes the actors the first one parked (workers/driver/actors.py).
    # On the local Ray it starts, on CPU, the trainer colocates each agent's learner and
    # engine by default (`colocate="auto"`): one host actor per agent.
    assert out.count("comlrl-split: actors started: 2 learner+engine hosts, "
                     "1 checkpointer") == 1
    assert out.count("comlrl-split: actors reused from the previous train(): 2 "
                     "learner+engine hosts, 1 checkpointer") == 1
    assert "checkpoints written: checkpoint-1, checkpoint-2 in " in out
    assert "checkpoints written: checkpoint-3, checkpoint-4 in " in out
    assert out.count("comlrl-split: W&B run: ") == 2
    assert "upload it with: wandb sync " in out
    logs = demo_run.output_dir / "checkpoints" / "logs"
    assert f"actor logs: {logs}" in out
    for noise in ("RotaryEmbedding", "ZeroCopyTensorsWarning", "not writable", "LD_PRELOAD",
                  "Loading weights", "Writing model shards"):
        assert noise not in out, noise
    names = {p.name for p in logs.glob("*.log")}
    assert names == {"host-agent0.log", "host-agent1.log", "checkpointer.log"}, names
    assert "vllm" in (logs / "host-agent0.log").read_text().lower()   # vLLM's own output


def test_demo_writes_a_readable_training_curve_png(demo_run):
    assert demo_run.proc.returncode == 0, demo_run.output[-6000:]
    png = demo_run.png_path
    assert png.is_file(), f"no {png}; the demo said:\n{demo_run.output[-3000:]}"
    assert png.read_bytes()[:8] == PNG_MAGIC
    from matplotlib.image import imread

    height, width = imread(png).shape[:2]
    assert width > 0 and height > 0
    assert f"training curve: {png}" in demo_run.output
