"""Command-line entry point for cluster jobs: one YAML file describes a whole MAGRPO run.

    python -m workers.cli CONFIG.yaml [key=value ...] [--resume PATH|latest] [--print-config]
    comlrl-split CONFIG.yaml ...                      (the same, as an installed script)

`key=value` overrides use dotted keys (`magrpo.num_train_epochs=8`), values parsed as YAML (`4`
is an int, `null` None, `[a, b]` a list). `--resume latest` continues from the newest
`checkpoint-N` in `checkpoint_dir`, or starts fresh when there is none, so one command serves
a first submission and every resubmission of a preempted job. The console (`ray job logs`) is
kept short; actors write to `<output_dir>/logs` (`workers.console`; `--verbose` for all).
The fields of the YAML file are those of `JobConfig` below; `examples/seed_config.yaml` is one.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import importlib
import importlib.util
import inspect
import json
import os
import sys
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from comlrl.checkpoint import (
    CheckpointError,
    list_checkpoints,
    recover_interrupted_commits,
    verify_checksums,
)
from comlrl.tiny_model import build_tiny_model
from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
from comlrl.utils import read_checkpoint_metadata
from workers import console

# Keys of the `wandb:` section: wandb.init's arguments that comlrl's wandb_config passes on,
# plus comlrl's `run_name` alias of `name`.
WANDB_KEYS = ("project", "entity", "name", "run_name", "dir", "tags", "id", "resume", "group",
              "notes", "job_type", "mode")


class ConfigError(ValueError):
    """A job config the CLI cannot run; the message names the key at fault."""


@dataclass
class JobConfig:
    """One training run, as the YAML file and its overrides describe it."""

    dataset: Any
    """Training prompts: an inline list (strings, or mappings with a `prompt` key), a json/jsonl/
    csv/parquet file, a `datasets` hub name, or a mapping of `datasets.load_dataset` arguments
    (`path`, `name`, `split`, `data_files`). Rows need a plain `prompt` column."""
    reward_func: str
    """`module:function` or `path/to/file.py:function`; called as in comlrl (one list per agent)."""
    model: Any = "tiny"
    """Model folder or hub name; `tiny` (or `tiny: {build_tiny_model kwargs}`) builds a tiny
    random-weight model into `output_dir/tiny-model` (the same bytes every time)."""
    model_config: dict = field(default_factory=dict)
    """Passed to MAGRPOTrainer's `model_config` (e.g. `dtype`, `special_tokens`)."""
    num_agents: int = 2
    """Number of agents, each a copy of `model`."""
    eval_dataset: Any = None
    """Evaluation prompts, in any form `dataset` accepts (None: no evaluation)."""
    reward_processor: str | None = None
    """Optional `module:function` mapping each reward (comlrl's `reward_processor`)."""
    external_transition: str | None = None
    """`module:function` giving the next turn's prompts; required when magrpo.num_turns > 1."""
    formatters: Any = None
    """Optional `module:function` (all agents) or a list of them (one per agent)."""
    magrpo: dict = field(default_factory=dict)
    """MAGRPOConfig fields; MAGRPOConfig validates them."""
    wandb: dict | None = field(default_factory=dict)
    """wandb_config of the trainer (project, entity, name, tags, mode, ...); null disables W&B."""
    output_dir: str | None = None
    """Where the tiny model, W&B files and (by default) checkpoints go; default
    `runs/<config name>`. Use an absolute path on shared storage for cluster jobs: a Ray job's
    current folder is a temporary copy of the working dir."""
    checkpoint_dir: str | None = None
    """Checkpoint folder (default `<output_dir>/checkpoints`; relative: under output_dir)."""
    checkpoint_interval: int = 1
    """Save `checkpoint-N` after every this many epochs (and after the last one)."""
    checkpoint_total_limit: int | None = None
    """Keep only the newest this many checkpoints (None: keep all)."""


JOB_KEYS = tuple(f.name for f in fields(JobConfig))
REQUIRED = {"dataset": "the training prompts: an inline list, a file or a datasets name",
            "reward_func": "module:function or path/to/file.py:function"}


# ---------------------------------------------------------------------- config loading


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], value parsed as YAML)."""
    import yaml

    key, sep, raw = text.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise ConfigError(f"override {text!r} is not key=value (e.g. magrpo.num_train_epochs=4).")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw  # not valid YAML: keep the text as a string
    if isinstance(value, (dict, list)) and not raw.lstrip().startswith(("[", "{")):
        value = raw  # `name=run: 7` is a string; only [..] / {..} make a list or mapping
    return key.strip().split("."), value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """A copy of `raw` with every `key=value` in `overrides` applied, in order."""
    if not isinstance(raw, dict):
        raise ConfigError(f"the config must be a YAML mapping of keys (got {type(raw).__name__}).")
    out = copy.deepcopy(raw)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for i, part in enumerate(path[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            elif i == 0 and part == "model" and nxt == "tiny":
                nxt = node[part] = {"tiny": {}}  # `model.tiny.seed=1` on `model: tiny`
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(path[:i + 1])} is "
                                  f"{nxt!r}, not a mapping, so it has no key {path[i + 1]!r}.")
            node = nxt
        node[path[-1]] = value
    return out


def _unknown(key: str, known: tuple[str, ...] | list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], known, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(known))}."
    return ConfigError(f"unknown config key {key!r}{where}; {hint}")


def build_job_config(raw: dict) -> JobConfig:
    """Validate the merged YAML + overrides into a JobConfig (MAGRPOConfig checks `magrpo`)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"the config must be a YAML mapping of keys (got {type(raw).__name__}).")
    for key in raw:
        if key not in JOB_KEYS:
            raise _unknown(str(key), JOB_KEYS, "")
    for f in fields(JobConfig):
        if f.default is MISSING and f.default_factory is MISSING and raw.get(f.name) is None:
            raise ConfigError(f"config key {f.name!r} is required ({REQUIRED[f.name]}).")
    job = JobConfig(**raw)
    for name in ("magrpo", "model_config"):
        if getattr(job, name) is None:
            setattr(job, name, {})
        if not isinstance(getattr(job, name), dict):
            raise ConfigError(f"{name} must be a mapping (got {getattr(job, name)!r}).")
    magrpo_keys = [f.name for f in fields(MAGRPOConfig)]
    for key in job.magrpo:
        if key not in magrpo_keys:
            raise _unknown(f"magrpo.{key}", magrpo_keys, " (not a MAGRPOConfig field)")
    if job.wandb is not None:
        if not isinstance(job.wandb, dict):
            raise ConfigError(f"wandb must be a mapping or null (got {job.wandb!r}).")
        for key in job.wandb:
            if key not in WANDB_KEYS:
                raise _unknown(f"wandb.{key}", WANDB_KEYS, " (not a wandb_config key)")
    for name in ("num_agents", "checkpoint_interval"):
        value = getattr(job, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1 (got {value!r}).")
    limit = job.checkpoint_total_limit
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"checkpoint_total_limit must be null or >= 1 (got {limit!r}).")
    if "num_agents" in job.magrpo and job.magrpo["num_agents"] != job.num_agents:
        raise ConfigError(f"magrpo.num_agents={job.magrpo['num_agents']!r} disagrees with "
                          f"num_agents={job.num_agents!r}; set only num_agents.")
    try:
        MAGRPOConfig(**{**job.magrpo, "num_agents": job.num_agents})
    except (TypeError, ValueError) as exc:  # TypeError: e.g. a string where a number goes
        raise ConfigError(f"magrpo: {exc}") from exc
    tiny_kwargs(job.model)  # validates a `tiny:` mapping early
    return job


def load_job_config(path: str | os.PathLike, overrides: list[str] = ()) -> JobConfig:
    """Read CONFIG.yaml, apply `key=value` overrides, validate; output_dir made absolute."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} not found.")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p} is not valid YAML: {exc}") from exc
    job = build_job_config(apply_overrides(raw, list(overrides)))
    out = Path(job.output_dir) if job.output_dir else Path("runs") / p.stem
    job.output_dir = str(out.expanduser().resolve())
    ckpt = Path(job.checkpoint_dir or "checkpoints").expanduser()
    job.checkpoint_dir = str(ckpt if ckpt.is_absolute() else Path(job.output_dir) / ckpt)
    return job


# ---------------------------------------------------------------------- resolving the parts


def load_callable(spec: str, what: str = "reward_func") -> Callable:
    """`package.module:function` or `path/to/file.py:function` -> the function.

    Module names are imported with the current folder on sys.path (as `python -m` has it). A
    file inside the current folder gets its dotted module name (`examples/rewards.py` ->
    `examples.rewards`), so both spellings name the same function for the resume check.
    """
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(f"{what} must be 'module:function' or 'path/to/file.py:function' "
                          f"(got {spec!r}).")
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ConfigError(f"{what} {spec!r}: give both the module (or .py file) and the "
                          f"function name, e.g. examples.rewards:length_ratio_reward.")
    if target.endswith(".py") or os.sep in target or "/" in target:
        module = _import_file(Path(target), spec, what)
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            raise ConfigError(f"{what} {spec!r}: cannot import module {target!r} ({exc}). "
                              f"Check the name, or give a file path: path/to/file.py:{attr}."
                              ) from exc
    func = getattr(module, attr, None)
    if func is None:
        public = [n for n in dir(module) if not n.startswith("_")
                  and callable(getattr(module, n))]
        raise ConfigError(f"{what} {spec!r}: {target!r} has no attribute {attr!r} "
                          f"(callables there: {', '.join(public) or 'none'}).")
    if not callable(func):
        raise ConfigError(f"{what} {spec!r}: {attr!r} is a {type(func).__name__}, not a "
                          f"function.")
    return func


def _import_file(path: Path, spec: str, what: str):
    if not path.is_file():
        raise ConfigError(f"{what} {spec!r}: file {path} not found.")
    path = path.resolve()
    try:
        parts = path.with_suffix("").relative_to(Path.cwd().resolve()).parts
    except ValueError:
        parts = ()
    name = ".".join(parts) if parts and all(p.isidentifier() for p in parts) else path.stem
    existing = sys.modules.get(name)
    if existing is not None and getattr(existing, "__file__", None) and \
            Path(existing.__file__).resolve() == path:
        return existing
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # so pickling and inspect.getsource can find it
    try:
        module_spec.loader.exec_module(module)
    except Exception:
        sys.modules.pop(name, None)
        raise
    return module


def tiny_kwargs(model: Any) -> dict | None:
    """build_tiny_model's keyword arguments when `model` asks for a tiny model, else None."""
    if model == "tiny":
        return {}
    if isinstance(model, dict):
        if set(model) != {"tiny"}:
            raise ConfigError(f"model must be a path, a hub name, 'tiny' or a mapping "
                              f"{{tiny: {{...}}}} (got keys {sorted(model)}).")
        kwargs = model["tiny"] or {}
        if not isinstance(kwargs, dict):
            raise ConfigError(f"model.tiny must be a mapping of build_tiny_model arguments "
                              f"(got {kwargs!r}).")
        allowed = [n for n in inspect.signature(build_tiny_model).parameters if n != "output_dir"]
        for key in kwargs:
            if key not in allowed:
                raise _unknown(f"model.tiny.{key}", allowed, " (not a build_tiny_model argument)")
        return dict(kwargs)
    if not isinstance(model, str) or not model:
        raise ConfigError(f"model must be a path, a hub name or 'tiny' (got {model!r}).")
    return None


def resolve_model(job: JobConfig) -> str:
    kwargs = tiny_kwargs(job.model)
    if kwargs is None:
        return job.model

    # Rebuilt on every start: same arguments, same bytes, so a resume's fingerprint matches.
    return str(build_tiny_model(Path(job.output_dir) / "tiny-model", **{"seed": 0, **kwargs}))


def load_rows(spec: Any, what: str = "dataset"):
    """A list of row dicts, or a `datasets.Dataset`, from any form `JobConfig.dataset` takes."""
    if isinstance(spec, list):
        rows = [{"prompt": r} if isinstance(r, str) else r for r in spec]
        bad = [r for r in rows if not isinstance(r, dict) or "prompt" not in r]
        if not rows or bad:
            raise ConfigError(f"{what}: an inline list needs prompt strings or mappings with a "
                              f"'prompt' key (got {bad[0] if bad else 'an empty list'!r}).")
        return rows
    import datasets

    if isinstance(spec, str):
        spec = {"path": spec}
    if not isinstance(spec, dict) or "path" not in spec:
        raise ConfigError(f"{what} must be a list of prompts, a file, a datasets name, or a "
                          f"mapping with 'path' (got {spec!r}).")
    kwargs = {"split": "train", **spec}
    path = str(kwargs.pop("path"))
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix in ("json", "jsonl", "csv", "parquet", "txt"):
        if not Path(path).is_file():
            raise ConfigError(f"{what}: file {path} not found.")
        builder = {"jsonl": "json"}.get(suffix, suffix)
        kwargs.setdefault("data_files", path)
        path = "text" if builder == "txt" else builder
    try:
        return datasets.load_dataset(path, **kwargs)
    except Exception as exc:  # FileNotFoundError, DatasetNotFoundError, ConnectionError, ...
        raise ConfigError(f"{what}: could not load {spec!r} with datasets.load_dataset "
                          f"({type(exc).__name__}: {exc}).") from exc


def latest_checkpoint(checkpoint_dir: str | os.PathLike) -> Path | None:
    """The newest whole, undamaged `checkpoint-N` of `checkpoint_dir`, or None.

    A damaged newest one (a changed or missing file) is passed over, saying so on the console,
    so an automatically resubmitted job resumes from the one before, not failing forever."""
    if not Path(checkpoint_dir).is_dir():
        return None
    recover_interrupted_commits(checkpoint_dir)
    for path in reversed(list_checkpoints(checkpoint_dir)):
        try:
            verify_checksums(path)
            return path
        except (CheckpointError, OSError) as exc:
            console.problem(f"--resume latest: skipping damaged {path} ({exc}); resuming "
                            f"from the checkpoint before it.")
    return None


def resolve_resume(resume: str | None, checkpoint_dir: str) -> Path | None:
    if resume is None or resume == "latest":
        return resume and latest_checkpoint(checkpoint_dir)
    path = Path(resume).expanduser()
    if not path.is_dir():
        raise ConfigError(f"--resume {resume}: no such checkpoint folder.")
    return path.resolve()


def wandb_config_for(job: JobConfig, checkpoint: Path | None) -> dict | None:
    """The trainer's wandb_config: the `wandb:` section, W&B files under output_dir unless
    told otherwise, and on resume the checkpoint's run identity with resume='allow'."""
    if job.wandb is None:
        return None
    config = dict(job.wandb)
    if "dir" not in config and not os.environ.get("WANDB_DIR"):
        config["dir"] = job.output_dir
    if checkpoint is not None:
        identity = read_checkpoint_metadata(checkpoint).get("wandb")
        if identity:
            config = {**config, **identity, "resume": "allow"}
    return config


# ---------------------------------------------------------------------- running


def run(job: JobConfig, resume: str | None = None):
    """Build the trainer from `job` and train it; returns the trainer."""
    Path(job.output_dir).mkdir(parents=True, exist_ok=True)
    checkpoint = resolve_resume(resume, job.checkpoint_dir)
    if resume == "latest" and checkpoint is None:
        console.say(f"--resume latest: no checkpoint in {job.checkpoint_dir}; starting a new run")
    console.default_wandb_offline(job.wandb)  # no key, no mode: offline, not a login prompt
    reward = load_callable(job.reward_func, "reward_func")
    processor, transition = (load_callable(getattr(job, key), key) if getattr(job, key) else None
                             for key in ("reward_processor", "external_transition"))
    formatters = job.formatters                 # a "module:name" spec, a list of them, or None
    if isinstance(formatters, str):
        formatters = load_callable(formatters, "formatters")
    elif isinstance(formatters, list):
        formatters = [load_callable(f, f"formatters[{i}]") for i, f in enumerate(formatters)]
    args = MAGRPOConfig(**{**job.magrpo, "num_agents": job.num_agents})
    with console.quiet_progress_bars(console.full_output(args.verbose)):  # no weight bars
        model = resolve_model(job)
        trainer = MAGRPOTrainer(
            agent_model=model, num_agents=job.num_agents, model_config=job.model_config,
            train_dataset=load_rows(job.dataset, "dataset"),
            eval_dataset=load_rows(job.eval_dataset, "eval_dataset") if job.eval_dataset else None,
            reward_func=reward, reward_processor=processor, external_transition=transition,
            formatters=formatters, wandb_config=wandb_config_for(job, checkpoint), args=args)
    console.say(f"model={model} agents={job.num_agents} prompts={len(trainer.train_rows)} "
                f"epochs={args.num_train_epochs} checkpoint_dir={job.checkpoint_dir} "
                f"resume={checkpoint or 'no'} python={sys.executable}")
    trainer.train(checkpoint_dir=job.checkpoint_dir, checkpoint_interval=job.checkpoint_interval,
                  resume_from_checkpoint=str(checkpoint) if checkpoint else None,
                  checkpoint_total_limit=job.checkpoint_total_limit)
    console.say(f"done: env_step={trainer.env_step} newest checkpoint="
                f"{latest_checkpoint(job.checkpoint_dir)}")
    return trainer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="comlrl-split", description="Train MAGRPO agents from a YAML config.",
        epilog="Example: python -m workers.cli examples/seed_config.yaml "
               "output_dir=/shared/runs/demo magrpo.num_train_epochs=8 --resume latest")
    parser.add_argument("config", help="the YAML config file")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted-key overrides, values parsed as YAML")
    parser.add_argument("--resume", metavar="PATH|latest", help="a checkpoint folder, or "
                        "'latest' (newest in checkpoint_dir; none there: start fresh)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as JSON and exit")
    parser.add_argument("--verbose", action="store_true",
                        help=f"all actor output on the console (vLLM, Ray, transformers), as "
                             f"{console.VERBOSE_ENV}=1 does; default: in per-actor log files")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_intermixed_args(argv)
    os.environ.update({console.VERBOSE_ENV: "1"} if ns.verbose else {})  # console.full_output
    try:
        job = load_job_config(ns.config, ns.overrides)
        if ns.print_config:
            print(json.dumps(asdict(job), indent=2, default=str))
            return 0
        run(job, ns.resume)
    except ConfigError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
