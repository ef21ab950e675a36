"""deploy/: every file checked as far as this machine allows, and one real `ray job submit`.

Static checks: YAML parses (the `ray up` file through Ray's own schema), the Dockerfiles pin
what pyproject.toml pins, the shell scripts pass `bash -n`, and every command line that runs
the CLI is one the CLI accepts. The slow test starts a Ray head on loopback, submits the seed
config as a job, stops it part-way, and resubmits it with `--resume latest`.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.conftest import TEST_ENV, wandb_history
from workers import cli

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
VENV_BIN = Path(sys.executable).parent


def pyproject_pins() -> dict[str, str]:
    """name -> version of every `name==version` (extras dropped) in pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + [d for ds in project["optional-dependencies"].values()
                                       for d in ds]
    pins = {}
    for spec in specs:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?==([^;\s]+)", spec.strip())
        if m:
            pins[m.group(1).lower()] = m.group(3)
    return pins


def dockerfile_pins(path: Path) -> dict[str, str]:
    text = path.read_text()
    return {m.group(1).lower(): m.group(3)
            for m in re.finditer(r"[\"' ]([A-Za-z][A-Za-z0-9_.-]*)(\[[^\]]*\])?==([\w.+-]+)", text)}


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with comments dropped and continuation lines joined."""
    logical, out = "", []
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        logical += line.rstrip("\\").rstrip() + " "
        if not line.rstrip().endswith("\\"):
            word, _, rest = logical.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            logical = ""
    return out


def cli_args_of(command: str) -> list[str]:
    """The arguments after `python -m workers.cli` in a shell command line."""
    words = shlex.split(command)
    i = words.index("workers.cli")
    assert words[i - 1] == "-m" and "python" in words[i - 2], command
    return words[i + 1:]


# ---------------------------------------------------------------- static checks


def test_gpu_dockerfile_pins_match_pyproject():
    pins, docker = pyproject_pins(), dockerfile_pins(DEPLOY / "Dockerfile.gpu")
    for name in ("vllm", "torch", "transformers", "ray"):
        assert docker.get(name) == pins[name], f"{name}: Dockerfile.gpu {docker.get(name)} " \
                                               f"vs pyproject {pins[name]}"
    for name, version in docker.items():  # and nothing else pinned differently
        assert pins.get(name, version) == version, name
    assert pins["vllm"] == "0.32.0" and pins["transformers"] == "5.19.0" \
        and pins["ray"] == "2.60.0"


@pytest.mark.parametrize("name", ["Dockerfile.gpu", "Dockerfile.cpu"])
def test_dockerfiles_are_well_formed(name):
    steps = dockerfile_instructions(DEPLOY / name)
    known = {"ARG", "FROM", "ENV", "RUN", "WORKDIR", "COPY", "CMD", "LABEL", "EXPOSE"}
    assert {w for w, _ in steps} <= known
    first = next(w for w, _ in steps if w != "ARG")
    assert first == "FROM"
    for word, args in steps:
        if word == "COPY":  # every source is in the repo (the build context is its root)
            for src in shlex.split(args)[:-1]:
                assert (ROOT / src).exists(), f"{name}: COPY {src}: not in the repo"
    runs = " ".join(a for w, a in steps if w == "RUN")
    if name == "Dockerfile.cpu":
        assert "deploy/setup.sh" in runs
        python = re.search(r"python:(\d+)\.(\d+)", dict(steps)["FROM"])
        assert python and (int(python[1]), int(python[2])) >= (3, 11)  # requires-python
    else:
        assert 'pip install -e ".[gpu]"' in runs
    assert "workers.cli" in dict(steps)["CMD"]


def test_runtime_env_excludes_outputs_and_sets_engine_env():
    env = yaml.safe_load((DEPLOY / "runtime_env.yaml").read_text())
    assert env["working_dir"] == "."
    for path in (".venv", "runs", "wandb", "checkpoints", ".git"):
        assert path in env["excludes"]
    assert env["env_vars"] == {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                               "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                               "TOKENIZERS_PARALLELISM": "false"}
    # W&B mode and loopback-only Ray settings are the user's or the test's, never forced here.
    assert not {k for k in env["env_vars"] if k.startswith("WANDB")}


def test_ray_cluster_yaml_passes_rays_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    validate_config(prepare_config(copy.deepcopy(config)))  # what `ray up` runs first
    head = " ".join(config["head_start_ray_commands"])
    assert "ray start --head" in head and "--dashboard-host=127.0.0.1" in head
    assert "--address=$RAY_HEAD_IP" in " ".join(config["worker_start_ray_commands"])
    assert "--gpus all" in config["docker"]["run_options"]


def test_kuberay_rayjob_runs_the_cli(tmp_path):
    job = yaml.safe_load((DEPLOY / "kuberay-rayjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    spec = job["spec"]
    args = cli_args_of(spec["entrypoint"])
    assert args[-2:] == ["--resume", "latest"]
    # The entrypoint's config and overrides are ones the CLI accepts.
    config, overrides = args[0], [a for a in args[1:-2]]
    loaded = cli.load_job_config(ROOT / config, overrides)
    assert loaded.magrpo["rollout_num_gpus"] == 1 and loaded.output_dir.startswith("/data/")
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert runtime_env["env_vars"] == \
        yaml.safe_load((DEPLOY / "runtime_env.yaml").read_text())["env_vars"]
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == pyproject_pins()["ray"]
    workers = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert workers["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert workers["image"] == head["image"] == \
        yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())["docker"]["image"]


@pytest.mark.parametrize("script", ["submit.sh", "slurm.sbatch", "setup.sh"])
def test_shell_scripts_parse(script):
    subprocess.run(["bash", "-n", str(DEPLOY / script)], check=True)


def test_submit_script_builds_the_job_command():
    env = {**os.environ, "DRY_RUN": "1", "RAY_ADDRESS": "http://127.0.0.1:1",
           "RAY_JOB_ARGS": "--no-wait --submission-id s1"}
    out = subprocess.run(["bash", str(DEPLOY / "submit.sh"), "examples/seed_config.yaml",
                          "output_dir=/tmp/x y", "--resume", "latest"], env=env,
                         capture_output=True, text=True, check=True).stdout
    words = shlex.split(out)
    assert words[:words.index("--")] == [
        "ray", "job", "submit", "--address", "http://127.0.0.1:1", "--runtime-env",
        "deploy/runtime_env.yaml", "--working-dir", ".", "--no-wait", "--submission-id", "s1"]
    assert words[words.index("--") + 1:] == ["python", "-m", "workers.cli",
                                             "examples/seed_config.yaml", "output_dir=/tmp/x y",
                                             "--resume", "latest"]
    usage = subprocess.run(["bash", str(DEPLOY / "submit.sh")], capture_output=True, text=True)
    assert usage.returncode == 2 and "RAY_ADDRESS" in usage.stdout


def test_slurm_script_starts_ray_and_resumes():
    text = (DEPLOY / "slurm.sbatch").read_text()
    assert "#SBATCH --requeue" in text
    assert re.search(r"RAY\"? start --head", text) and "--block" in text
    assert '-m workers.cli --resume latest "$@"' in text


# ---------------------------------------------------------------- ray job submit, end to end


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _stop_head(temp_dir: str) -> None:
    """`ray stop --force`, but only for the head started with `--temp-dir=temp_dir`.

    `ray stop` kills every Ray process on the machine, other tests' clusters included; here
    the head's daemons are found by their session paths, and with them every process they
    started (actors and job drivers have their titles rewritten, so only ancestry finds them).
    """
    import psutil

    roots = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in part for part in proc.info["cmdline"] or []):
                roots.append(proc)
        except psutil.Error:
            pass
    procs = {p.pid: p for p in roots}
    for proc in roots:
        try:
            procs.update({c.pid: c for c in proc.children(recursive=True)})
        except psutil.Error:
            pass
    procs.pop(os.getpid(), None)
    for proc in procs.values():
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    psutil.wait_procs(list(procs.values()), timeout=10)


def _ray(env: dict, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "ray"), *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def _job_status(address: str, job_id: str) -> str:
    from ray.job_submission import JobSubmissionClient  # HTTP only: no Ray in this process

    return str(JobSubmissionClient(address).get_job_status(job_id).value)


def _job_driver(out: Path):
    """The job's driver: the `python -m workers.cli ... output_dir=<out>` process that Ray's
    job supervisor started (not `ray job submit`, whose command line holds the same words)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if cmd[1:3] == ["-m", "workers.cli"] and f"output_dir={out}" in cmd:
            found.append(proc)
    assert len(found) == 1, [p.info["cmdline"] for p in found]
    return found[0]


def _sigterm_pending(pid: int) -> bool:
    """Whether a SIGTERM waits for process `pid` (its shared pending mask, /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True                     # gone: whatever was sent has landed
    if "\nState:\tZ" in status:
        return True                     # killed (a zombie until reaped)
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("ShdPnd:"))
    return bool(int(mask, 16) & (1 << (signal.SIGTERM - 1)))


@pytest.mark.e2e
@pytest.mark.slow
def test_ray_job_submit_stop_and_resume_latest(tmp_path):
    out = tmp_path / "run"
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's socket paths
    gcs, dash, *ports = _free_ports(9)
    address = f"http://127.0.0.1:{dash}"
    # The job's driver inherits the raylet's environment: loopback Ray, no auth, no usage
    # stats, offline W&B under tmp, and the venv first on PATH so `python` is the venv's.
    env = {**os.environ, **TEST_ENV, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
           "WANDB_MODE": "offline", "WANDB_DIR": str(out)}
    env.pop("WANDB_SERVICE", None)  # never join this pytest process's W&B service
    env.pop("WANDB_API_KEY", None)
    env.pop("RAY_ADDRESS", None)
    submit = [str(DEPLOY / "submit.sh"), "examples/seed_config.yaml", f"output_dir={out}"]
    ckpts = out / "checkpoints"
    try:
        started = _ray(
            env, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
            "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--include-dashboard=true",
            "--num-cpus=2", "--num-gpus=0", f"--temp-dir={temp_dir}",
            f"--object-store-memory={512 * 1024 * 1024}", "--disable-usage-stats",
            f"--ray-client-server-port={ports[0]}", f"--dashboard-agent-listen-port={ports[1]}",
            f"--dashboard-agent-grpc-port={ports[2]}", f"--runtime-env-agent-port={ports[3]}",
            f"--metrics-export-port={ports[4]}", f"--node-manager-port={ports[5]}",
            f"--object-manager-port={ports[6]}", timeout=120)
        assert started.returncode == 0, started.stdout + started.stderr

        # 1) Submit; stop the job as soon as its first checkpoint is written.
        first = subprocess.run(submit, env={**env, "RAY_ADDRESS": address, "RAY_JOB_ARGS":
                                            "--no-wait --submission-id seed-a"},
                               capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert first.returncode == 0, first.stdout + first.stderr
        deadline = last_check = time.monotonic()
        deadline += 240
        uploaded = []
        while not (ckpts / "checkpoint-1").exists():
            assert time.monotonic() < deadline, "no checkpoint-1 within 240 s"
            if not uploaded:  # the job's copy of the repo, as runtime_env.yaml shaped it
                uploaded = list(Path(temp_dir).glob(
                    "session_*/runtime_resources/working_dir_files/*/examples/seed_config.yaml"))
            if time.monotonic() - last_check > 3:  # a job that failed: fail now, with its log
                last_check = time.monotonic()
                assert _job_status(address, "seed-a") in ("PENDING", "RUNNING"), _ray(
                    env, "job", "logs", "--address", address, "seed-a").stdout[-5000:]
            time.sleep(0.1)
        # The driver is frozen the moment checkpoint-1 is seen, so the stop lands there and
        # not after the run's end: the tiny model's last three epochs took less time than
        # `ray job stop` takes to start, and once the job finished first (a red CI run).
        # Ray's SIGTERM waits while the driver is stopped and is delivered when it goes on.
        driver = _job_driver(out)
        driver.send_signal(signal.SIGSTOP)
        stopped = _ray(env, "job", "stop", "--no-wait", "--address", address, "seed-a",
                       timeout=120)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        deadline = time.monotonic() + 60
        while not _sigterm_pending(driver.pid):
            assert time.monotonic() < deadline, "ray job stop sent the driver no SIGTERM"
            time.sleep(0.05)
        driver.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 60
        while _job_status(address, "seed-a") != "STOPPED":
            assert time.monotonic() < deadline, _job_status(address, "seed-a")
            time.sleep(0.2)
        assert not (ckpts / "checkpoint-4").exists(), "the job finished before it was stopped"
        assert uploaded, "the job's working dir was never found"
        package = uploaded[0].parents[1]
        for excluded in (".venv", "runs", "wandb", ".git"):
            assert not (package / excluded).exists(), f"{excluded} was uploaded"
        logs_a = _ray(env, "job", "logs", "--address", address, "seed-a").stdout
        assert "MAGRPO" in logs_a and f"python={VENV_BIN / 'python'}" in logs_a, logs_a[-3000:]

        # 2) Resubmit the same command with --resume latest: it completes the run.
        second = subprocess.run(submit + ["--resume", "latest"],
                                env={**env, "RAY_ADDRESS": address,
                                     "RAY_JOB_ARGS": "--submission-id seed-b"},
                                capture_output=True, text=True, timeout=300, cwd=ROOT)
        logs_b = _ray(env, "job", "logs", "--address", address, "seed-b").stdout
        assert _job_status(address, "seed-b") == "SUCCEEDED", logs_b[-5000:]
        assert "MAGRPO" in logs_b and "env_step=64" in logs_b, logs_b[-3000:]
        # What `ray job logs` shows is the quiet console: a header and a summary around the
        # bar; the actors' own output went to their log files.
        for said in ("comlrl-split: actors started: ", "comlrl-split: checkpoints written: ",
                     "comlrl-split: W&B run: ", "comlrl-split: actor logs: "):
            assert said in logs_b, (said, logs_b[-3000:])
        assert "RotaryEmbedding" not in logs_b and "Loading weights" not in logs_b
        assert re.search(r"resume=\S+/checkpoints/checkpoint-[123]\b", logs_b), logs_b[-3000:]
        assert second.returncode == 0
    finally:
        _stop_head(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)

    assert sorted(p.name for p in ckpts.glob("checkpoint-*")) == \
        [f"checkpoint-{n}" for n in (1, 2, 3, 4)]
    history = wandb_history(out)
    runs = {r["_run"].rsplit("-", 1)[1] for r in history}
    assert len(runs) == 1, f"the resumed job logged to another W&B run: {runs}"
    steps = [r["_step"] for r in history if "turn_1/reward_mean" in r]
    assert len(steps) == len(set(steps)), f"duplicate env_steps in W&B: {sorted(steps)}"
    # Aligned single turn: +4 env_steps per prompt, an update (and a log) every 2 prompts.
    # `ray job stop` signals the whole process group, W&B's service too, so rows in flight can
    # be lost; the checkpoint carries its rows and the resumed job re-sends the ones the run's
    # files lack, and redoes the rest: every step once, none missing.
    assert sorted(steps) == list(range(8, 65, 8)), sorted(steps)
