"""The actors one `train()` runs on: built, started (or taken warm from this process's previous
`train()`), wired to a weight transport, then parked or killed when it ends.

Warm actors: on a local Ray this process started, a `train()` that ends cleanly parks its
actors instead of killing them. The next `train()` whose actors would be built the same way
(`warm_key`: roles and resources, engine, sampling and learner settings, the models'
architecture and tokenizer files, the log folder) takes them: its learners start over from
its own models (`Learner.reinit`) or load its checkpoint, and those weights are pushed to the
engines before any rollout, so it computes what fresh actors would. The seed example's resume
so starts without importing vLLM and torch in five new processes (BENCHMARKS.md). Any other
start drops them first: parked actors hold their Ray resources.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from comlrl.lora import (
    ADAPTER_CONFIG,
    adapter_folder,
    base_state_dict,
    is_peft_model,
    save_lora_folder,
)
from comlrl.rollout import longest_sequence, sequences_per_call
from workers.console import quiet_progress_bars
from workers.driver.cluster import WARM_ACTORS
from workers.driver.placement import place, remove_placement
from workers.driver.pool import RolloutPool
from workers.engines import KV_BLOCK_TOKENS, kv_blocks
from workers.model_source import pack_model_folder
from workers.ray_calls import is_alive, kill_actors, ray_get, start_actor
from workers.roles.agent_host import AgentHost
from workers.roles.learner import Learner
from workers.roles.rollout_worker import RolloutWorker
from workers.transports.choice import make_transport
from workers.transports.endpoints import with_learner_endpoint
from workers.transports.object_store import ObjectStoreTransport

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass
class Actors:
    """One train()'s actors and what they were built from."""

    key: str
    pool: Any                                     # workers.driver.pool.RolloutPool
    learners: list = field(default_factory=list)
    learner_specs: list = field(default_factory=list)   # to restart a learner (`Session.heal`)
    checkpointer: Any = None
    placement_group: Any = None
    transport: Any = None
    models: list = field(default_factory=list)    # fingerprints of the weights learners loaded

    def all(self) -> list:
        return self.pool.actors + self.learners + \
            ([self.checkpointer] if self.checkpointer is not None else [])


def actor_settings(trainer: Any, plan: dict, cores: int, n_workers: int) -> dict:
    """What every actor is built with, apart from its placement and the weights."""
    args = trainer.args
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    top_p=args.top_p, top_k=args.top_k)
    return {
        "engine": args.rollout_engine,
        "sampling": [{**sampling, "stop_token_ids": (tok.eos_token_id,)}
                     for tok in trainer.tokenizers],
        "engine_kwargs": dict(
            dtype=args.engine_dtype, enforce_eager=args.enforce_eager,
            max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            # Sized by default, the KV cache's bounds shape the engines (the warm key); the
            # tokens in whole blocks, so a later train()'s prompts that fit keep the engines.
            kv_cache_sequences=(None if args.kv_cache_memory_bytes
                                else sequences_per_call(args, trainer.num_agents)),
            kv_cache_tokens=None if args.kv_cache_memory_bytes else _in_blocks(
                longest_sequence(trainer)),
            tensor_parallel_size=args.tensor_parallel_size,
            gpu_memory_utilization=plan["gpu_memory_utilization"],
            enable_sleep_mode=args.enable_sleep_mode, seed=args.seed,
            threads=threads_each(args.rollout_threads, cores, n_workers)),
        "learner": [dict(learning_rate=args.agent_learning_rate,
                         train_batch_size=args.train_batch_size,
                         loss_aggregation=args.loss_aggregation,
                         advantage_mode=args.advantage_mode,
                         advantage_normalization=args.advantage_normalization,
                         gradient_checkpointing=args.gradient_checkpointing,
                         reference_kl_coef=(args.reference_kl_coef
                                            if args.reference_kl_enabled else None),
                         device=args.learner_device_for(a, trainer.num_agents),
                         threads=threads_each(args.learner_threads, cores, trainer.num_agents))
                    for a in range(trainer.num_agents)],
    }


def lora_engine_groups(trainer: Any, folders: list[str], settings: dict, hosts: bool) -> list:
    """The agent whose host's engine serves each agent (itself, unless shared). In the
    colocated layout LoRA agents whose bases are one file (`save_models` links equal bases)
    and whose adapters share a config and sampling settings share one vLLM engine, with one
    adapter each: one copy of the base in the engine instead of one per agent."""
    leaders = list(range(len(folders)))
    if not hosts or settings["engine"] != "vllm":
        return leaders
    seen: dict = {}
    for a, folder in enumerate(folders):
        adapter = adapter_folder(folder)
        if adapter is None:
            continue
        base = tuple(sorted((f.name, f.stat().st_ino, f.stat().st_dev)
                            for f in Path(folder).glob("*.safetensors")))
        group = (base, (adapter / ADAPTER_CONFIG).read_bytes(), repr(settings["sampling"][a]))
        leaders[a] = seen.setdefault(group, a)
    return leaders


def share_engines(settings: dict, args: Any, cores: int, leaders: list[int],
                  n_workers: int) -> dict:
    """`settings` for engines shared as `leaders` says (`lora_engine_groups`). The cores split
    among the engines started, and the learners of a group take turns in their updates on
    CPU (`workers.roles.learner.UpdateTurns`: one update's working memory per group, not one
    per agent), so they split among the groups: each runs at the cores one update gets."""
    settings = {**settings, "engine_leaders": list(leaders)}
    groups = len(set(leaders))
    if groups == len(leaders):
        return settings
    settings["engine_kwargs"] = {**settings["engine_kwargs"], "threads": threads_each(
        args.rollout_threads, cores, n_workers - len(leaders) + groups)}
    settings["learner"] = [
        {**kw, "take_turns": True, "threads": threads_each(args.learner_threads, cores, groups)}
        if leaders.count(leaders[a]) > 1 else kw for a, kw in enumerate(settings["learner"])]
    return settings


def threads_each(setting: int | None, cores: int, actors: int) -> int:
    """The torch threads of each of `actors` that run at once: the config's `setting`
    (rollout_threads, learner_threads), else an even share of the cores."""
    return setting or max(1, cores // actors)


def _in_blocks(tokens: int | None) -> int | None:
    return tokens and kv_blocks(tokens) * KV_BLOCK_TOKENS


def model_shape(folder: str) -> str:
    """A digest of a model folder without its weights: config, generation config, tokenizer.
    Actors built from folders with equal shapes differ only in weights, which are pushed."""
    digest = hashlib.sha256()
    adapter = adapter_folder(folder)    # a LoRA agent's engines are built for its adapter
    files = sorted(Path(folder).iterdir()) + ([adapter / ADAPTER_CONFIG] if adapter else [])
    for path in files:
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def warm_key(settings: dict, needs: list, plan: dict, folders: list[str], log_folder: Any,
             address: str | None) -> str:
    """Everything that shapes the actors; equal keys mean the parked actors can be taken."""
    return repr((settings, [(role, p.bundle()) for role, p in needs],
                 plan["strategy"], plan["transport"],
                 [model_shape(f) for f in folders], str(log_folder), address,
                 os.environ.get("COMLRL_VERBOSE")))


def take_warm(key: str) -> Actors | None:
    """The parked actors if they match `key` and all still answer; otherwise none (any parked
    ones are dropped)."""
    actors = WARM_ACTORS.pop("actors", None)
    if actors is None:
        return None
    if actors.key == key and all(is_alive(actor) for actor in actors.all()):
        return actors
    release(actors)
    return None


def warm_learners_hold(files: dict[str, str]) -> bool:
    """Whether every parked learner still holds exactly its folder of the checkpoint whose
    recorded digests are `files` (`Learner.holds`): its resume then reads none of them, so
    the driver's verify reads them past the page cache (`verify_checksums`)."""
    import ray

    actors = WARM_ACTORS.get("actors")
    if actors is None:
        return False
    try:
        return all(ray.get([learner.holds.remote(f"agent_{a}", files)
                            for a, learner in enumerate(actors.learners)], timeout=60))
    except Exception:  # noqa: BLE001 - a parked learner that died: take_warm drops them
        return False


def drop_warm() -> None:
    """Kill any parked actors (a start that cannot use them needs their resources)."""
    actors = WARM_ACTORS.pop("actors", None)
    if actors is not None:
        release(actors)


def park(actors: Actors) -> None:
    drop_warm()
    WARM_ACTORS["actors"] = actors


def release(actors: Actors) -> None:
    kill_actors(actors.all())
    remove_placement(actors.placement_group)


def save_models(trainer: Any, folder: str, show_progress: bool) -> tuple[list[str], dict]:
    """The trainer's initial models and tokenizers saved into `folder`, one folder per agent
    for the actors to load; returns those and the run's fingerprints, which hash the saved
    weights (`MAGRPOTrainer.fingerprints`). Each agent's weights are written by a thread of
    their own: writes mostly wait on the disk (BENCHMARKS.md)."""
    with quiet_progress_bars(show_progress):
        models = trainer._initial_models()     # models given by name are loaded here
        folders = [str(Path(folder) / f"agent_{i}") for i in range(len(models))]
        firsts = first_equal_bases(models)
        with ThreadPoolExecutor(len(models)) as pool:      # the bases first, then the links
            for linked in (False, True):
                agents = [i for i, f in enumerate(firsts) if (f != i) == linked]
                list(pool.map(lambda i: save_model_folder(
                    models[i], folders[i], folders[firsts[i]] if linked else None), agents))
        for tok, f in zip(trainer.tokenizers, folders):
            tok.save_pretrained(f)
    return folders, trainer.fingerprints(folders)


def save_model_folder(model: Any, folder: str, base_from: str | None = None) -> None:
    """What an actor loads an agent from: a `from_pretrained` folder, or a LoRA agent's
    base plus its adapter (`comlrl.lora.save_lora_folder`; `base_from`: the folder of an
    agent with the same base, whose files it links)."""
    if is_peft_model(model):
        save_lora_folder(model, folder, base_from)
    else:
        model.save_pretrained(folder, safe_serialization=True)


def first_equal_bases(models: list) -> list[int]:
    """For each agent, the first LoRA agent whose base weights equal its own (itself if
    none, or if it is not a LoRA agent): their folders link one base file, so the learners
    that map it share its pages, and one engine can serve their adapters."""
    import torch

    firsts, bases = [], {}
    for i, model in enumerate(models):
        first = i
        if is_peft_model(model):
            mine = base_state_dict(model)
            for j, theirs in bases.items():
                if mine.keys() == theirs.keys() and all(
                        mine[k].shape == theirs[k].shape and mine[k].dtype == theirs[k].dtype
                        and torch.equal(mine[k], theirs[k]) for k in mine):
                    first = j
                    break
            else:
                bases[i] = mine
        firsts.append(first)
    return firsts


def model_sources(folders: list[str], local: bool) -> list:
    """What the actors load the models from. On a local Ray this process started, the
    driver's folders themselves: every actor shares its disk. Elsewhere each folder is packed
    into the object store (`pack_model_folder`), as actors on other nodes cannot
    read the driver's disk; that costs start-up time (the driver reads and stores every
    model, each actor writes its own copy; BENCHMARKS.md, start-up)."""
    if local:
        return list(folders)
    import ray

    return [ray.put(pack_model_folder(f)) for f in folders]


def use_folders(actors: Actors, folders: list[str]) -> None:
    """Point taken warm actors' restart specs at this run's model folders: the folders of the
    run that parked them are gone (warm actors only live on a local Ray, so specs hold
    paths)."""
    actors.pool.specs = {(a, i): (*spec[:3], folders[a], *spec[4:])
                         for (a, i), spec in actors.pool.specs.items()}
    actors.learner_specs = [((*spec[:3], folders[a], *spec[4:]), kw)
                            for a, (spec, kw) in enumerate(actors.learner_specs)]


def actor_needs(args: Any, plan: dict, num_agents: int, for_eval: bool) -> list:
    """(role, Placement) of every actor in placement-group bundle order: each agent's rollout
    workers, then one learner per agent (none for `for_eval`). With `colocate`, one host per
    agent (its learner and worker 0, workers/roles/agent_host.py), then the agents' other
    workers."""
    per_agent = args.rollout_workers_per_agent
    if "host" in plan and not for_eval:
        return [("host", plan["host"])] * num_agents + \
            [("rollout", plan["rollout"])] * (num_agents * (per_agent - 1))
    needs = [("rollout", plan["rollout"])] * (num_agents * per_agent)
    return needs if for_eval else needs + [("learner", plan["learner"])] * num_agents


def start_actors(trainer: Any, logs: Any, key: str, settings: dict, needs: list, plan: dict,
                 folders: list[str], models: list, for_eval: bool, local: bool) -> Actors:
    """New rollout workers (in a RolloutPool) and, unless `for_eval`, learners, each in its
    own placement-group bundle (`actor_needs` order), logging where `logs`
    (workers.console.ActorLogs) says. `local`: on a local Ray this process started
    (`model_sources`). With `colocate` each agent's learner is its worker 0's actor."""
    args = trainer.args
    per_agent, n = args.rollout_workers_per_agent, trainer.num_agents
    placed, group = place(needs, plan["strategy"], args.placement_timeout_s)
    sources = model_sources(folders, local)
    hosts = "host" in plan and not for_eval
    bundles = iter(placed)
    specs = {}
    leaders = settings["engine_leaders"] if hosts else list(range(n))
    if hosts:
        for a in range(n):
            # One engine per group of LoRA agents on one base, in its first agent's host.
            serves = leaders.count(a)
            specs[a, 0] = (AgentHost, logs.place(next(bundles), "host", a), a, sources[a],
                           settings["engine"] if serves else None, settings["sampling"][a],
                           {**settings["engine_kwargs"], "lora_slots": serves},
                           settings["learner"][a])
    for a in range(n):
        for i in range(int(hosts), per_agent):
            specs[a, i] = (RolloutWorker, logs.place(next(bundles), "rollout", a, i), a,
                           sources[a], settings["engine"], settings["sampling"][a],
                           settings["engine_kwargs"])
    pool = RolloutPool(specs, n, per_agent, hosts=hosts, leaders=leaders)
    actors = Actors(key, pool, placement_group=group, models=models)
    if hosts:
        actors.learner_specs = [(specs[a, 0], {}) for a in range(n)]
        actors.learners = list(pool.hosts_of)
    elif not for_eval:
        # Kept to restart learners that die, with the same arguments and bundles (`heal`).
        actors.learner_specs = [
            ((with_learner_endpoint(Learner), logs.place(next(bundles), "learner", a),
              a, sources[a]), settings["learner"][a]) for a in range(n)]
        actors.learners = [start_actor(*spec, **kw) for spec, kw in actors.learner_specs]
    return actors


def reinit_learners(learners: list, learner_specs: list) -> None:
    """Warm learners start over from the models their specs name (`Learner.reinit`; the specs
    point at this run's folders, `use_folders`)."""
    ray_get([learner.reinit.remote(*spec[2:], **kw)
             for learner, (spec, kw) in zip(learners, learner_specs)],
            "re-initialising learners")


def connect_transport(args: Any, plan: dict, learners: list, workers: list):
    """The weight transport `plan` chose, connected to every learner and its workers.

    With weight_transport='auto', a GPU transport that cannot be set up falls back to the
    object store with a warning; an explicit choice fails instead."""
    gpus = plan["learner"].num_gpus > 0 and plan["rollout"].num_gpus > 0
    transport = make_transport(plan["transport"], backend="nccl" if gpus else "gloo",
                               bucket_bytes=args.weight_bucket_bytes)
    try:
        for a, learner in enumerate(learners):
            transport.connect(a, learner, workers[a])
    except Exception as exc:
        if args.weight_transport != "auto":
            raise
        warnings.warn(f"weight_transport='auto' chose {transport.name!r}, which could not "
                      f"be set up ({exc}); pushing weights through the Ray object store.")
        transport = ObjectStoreTransport()
    return transport
