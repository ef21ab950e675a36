"""Generation engines behind one interface: vLLM (the default) and Hugging Face `generate`.

An engine takes requests `{"prompt_ids": [...], "n": K, "seed": s}` and returns, per request,
K samples `{"token_ids": [...]}`. A request with `"logprobs": True` also gets `"logprobs"`,
the log-probs of the sampled tokens under the raw model distribution: training never reads
them, so they are computed only when asked for (a log-softmax over the vocabulary per token).
`load_weights(state_dict)` swaps in new weights without a restart.
Engines live inside rollout-worker actors or agent hosts (workers/roles/agent_host.py), never in
the driver: an in-process vLLM engine reseeds global RNGs and fixes the torch thread count of
its host process (docs/architecture.md, "Measured facts").
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from comlrl.loading import load_causal_lm
from comlrl.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_folder,
    adapter_rank,
    load_adapter_state,
)

# Set before vLLM is imported in an engine's process; no outside server is ever contacted.
ENGINE_ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "WARNING",
    # torch backs its large CPU allocations (>= 2 MB) with huge pages: a learner's first
    # update allocates gradients and AdamW moments, and in an actor the first touch of each
    # 4 KB page is costly; the 76.6M seed run is shorter with them (BENCHMARKS.md).
    "THP_MEM_ALLOC_ENABLE": "1",
    # glibc keeps what an update frees for the next one instead of returning it to the
    # kernel: one arena for all threads (Ray's call threads each had their own, whose heaps
    # are unmapped when empty), never trimmed, chunks up to 32 MiB (its maximum) from the heap.
    # With these an update's page faults end after the third update (BENCHMARKS.md section 0).
    "GLIBC_TUNABLES": "glibc.malloc.arena_max=1:glibc.malloc.trim_threshold=68719476736"
                      ":glibc.malloc.mmap_threshold=33554432",
}


@contextmanager
def imports_without_gc() -> Iterator[None]:
    """Run the block's imports (torch, transformers, vLLM) with Python's cyclic garbage
    collector paused, then collect once and freeze what they made.

    The ~640k objects of vLLM's imports set off full collections over everything imported so
    far: a large share of an engine import's CPU time (BENCHMARKS.md), paid by every actor
    at start on cores the other actors are starting on. The one collection after the block
    frees the imports' own garbage (13k objects, 12 MB); frozen, the rest is skipped by later ones.
    At exit they are unfrozen, so Python's last collection frees them as usual (frozen,
    triton's bindings reported themselves leaked). A block that imports nothing new (a warm
    learner's `reinit`, a host's learner after its engine) neither collects nor freezes: the
    objects alive then are a run's, such as the model about to be replaced."""
    enabled, modules = gc.isenabled(), len(sys.modules)
    gc.disable()
    try:
        yield
    finally:
        if len(sys.modules) > modules:
            gc.collect()
            gc.freeze()
            atexit.unregister(gc.unfreeze)          # registered once, however many blocks
            atexit.register(gc.unfreeze)
        if enabled:
            gc.enable()


@dataclass
class SamplingSettings:
    """What every request of a run samples with."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int | None
    stop_token_ids: tuple = ()
    """Token ids that end a completion (the tokenizer's eos), besides the model's own."""


class HFEngine:
    """Hugging Face `generate`, one call per request, seeded per request like vLLM."""

    def __init__(self, model_path: str, sampling: SamplingSettings, *, dtype: str = "auto",
                 device: str = "cpu", threads: int | None = None, **_: Any):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.threads = torch.get_num_threads()
        """Set again in each call's thread: an agent host's learner runs at its own count
        in the same process (`Learner._own_threads`)."""
        kwargs = {} if dtype == "auto" else {"dtype": getattr(torch, dtype)}
        self.model = load_causal_lm(model_path, **kwargs)
        self.lora = adapter_folder(model_path) is not None   # a LoRA agent: the base + adapter
        if self.lora:
            from peft import PeftModel

            self.model = PeftModel.from_pretrained(self.model, str(adapter_folder(model_path)))
        self.model = self.model.to(device).eval()
        self.device = device
        self.sampling = sampling
        gen = self.model.generation_config
        eos = gen.eos_token_id
        self.eos_ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        self.eos_ids = [e for e in self.eos_ids if e is not None] + list(sampling.stop_token_ids)
        self.pad_id = gen.pad_token_id if gen.pad_token_id is not None else self.eos_ids[0]

    def generate(self, requests: list[dict], adapter: Any = None) -> list[list[dict]]:
        """`adapter` must be None: an HF engine serves one agent."""
        import torch

        torch._C.set_num_threads(self.threads)
        s = self.sampling
        results = []
        for req in requests:
            ids = torch.tensor([req["prompt_ids"]], device=self.device)
            gen = torch.Generator(device="cpu").manual_seed(int(req["seed"]))
            # generate() draws from the global RNG: fork it so the draw depends on the seed only.
            with torch.random.fork_rng(devices=[]), torch.inference_mode():
                torch.manual_seed(int(gen.initial_seed()))
                out = self.model.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=True,
                    max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                    top_k=s.top_k or 0, num_return_sequences=int(req["n"]),
                    return_dict_in_generate=True, output_logits=bool(req.get("logprobs")),
                    pad_token_id=self.pad_id, eos_token_id=self.eos_ids,
                )
            new = out.sequences[:, ids.shape[1]:]
            picked = [None] * new.shape[0]
            if req.get("logprobs"):
                logp = torch.stack(out.logits, dim=1).float().log_softmax(-1)
                picked = logp.gather(-1, new.unsqueeze(-1)).squeeze(-1).tolist()
            samples = []
            for row, lp in zip(new.tolist(), picked):
                n = len(row)
                for i, t in enumerate(row):
                    if t in self.eos_ids:
                        n = i + 1
                        break
                samples.append({"token_ids": row[:n]} if lp is None else
                               {"token_ids": row[:n], "logprobs": lp[:n]})
            results.append(samples)
        return results

    def load_weights(self, state_dict: dict, adapter: Any = None) -> None:
        import torch

        if self.lora:
            with torch.no_grad():
                load_adapter_state(self.model, state_dict, "the new adapter of this engine")
            return
        with torch.no_grad():
            result = self.model.load_state_dict(state_dict, strict=False)
        check_loaded(self.model, result.missing_keys, result.unexpected_keys,
                     "the new weights of this engine")

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        import torch

        torch._C.set_num_threads(self.threads)
        with torch.inference_mode():
            ids = torch.tensor([token_ids], device=self.device)
            logits = self.model(ids).logits.float()
        logp = logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        return [0.0] + logp.tolist()

    def shutdown(self) -> None:
        self.model = None


CPU_KV_CACHE_CAP = 256 << 20
"""The most KV cache a CPU engine takes unless told (`kv_cache_memory_bytes=None`)."""
KV_BLOCK_TOKENS = 128
"""Tokens per KV block of vLLM's CPU attention: a sequence holds whole blocks."""
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def kv_blocks(tokens: int) -> int:
    """The whole KV blocks a sequence of `tokens` tokens takes."""
    return -(-tokens // KV_BLOCK_TOKENS)


def cpu_kv_cache_bytes(model_path: str, dtype: str, max_model_len: int | None,
                       sequences: int | None, tokens: int | None = None) -> int:
    """KV-cache bytes for `sequences` sequences of `tokens` tokens at once (the most one call
    of the run generates, `comlrl.rollout.sequences_per_call` and `longest_sequence`; the
    engine's longest length where `tokens` is None), at most CPU_KV_CACHE_CAP. vLLM's CPU
    backend zero-fills the whole cache while it starts, and touching memory is slow on
    these VMs: a 10M seed engine needs 10 MiB of the 256 (BENCHMARKS.md). Any
    model this cannot size exactly (no plain decoder config, scaled RoPE, an unknown dtype)
    gets the cap, as before."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
        heads = int(cfg["num_attention_heads"])
        per_token = (2 * int(cfg["num_hidden_layers"])
                     * int(cfg.get("num_key_value_heads") or heads)
                     * int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
                     * _DTYPE_BYTES[config_dtype(model_path) if dtype == "auto" else dtype])
        length = int(max_model_len or cfg["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return CPU_KV_CACHE_CAP
    if not sequences or cfg.get("rope_scaling") or "factor" in (cfg.get("rope_parameters") or {}):
        return CPU_KV_CACHE_CAP           # vLLM may lengthen the model past its config
    # Each sequence holds whole blocks; vLLM keeps one block back (its null block) and
    # refuses to start unless one sequence of the longest length fits. One block spare.
    blocks = max(sequences * kv_blocks(min(tokens or length, length)), kv_blocks(length)) + 2
    return min(CPU_KV_CACHE_CAP, blocks * KV_BLOCK_TOKENS * per_token)


class VLLMEngine:
    """An in-process vLLM engine (V1, no engine subprocess), fed token ids, seeded per request."""

    def __init__(self, model_path: str, sampling: SamplingSettings, *, dtype: str = "auto",
                 enforce_eager: bool = True, max_model_len: int | None = None,
                 kv_cache_memory_bytes: int | None = None, kv_cache_sequences: int | None = None,
                 kv_cache_tokens: int | None = None,
                 gpu_memory_utilization: float = 0.5,
                 tensor_parallel_size: int = 1, enable_sleep_mode: bool = False,
                 seed: int = 0, threads: int | None = None, lora_slots: int = 1, **_: Any):
        for key, value in ENGINE_ENV.items():
            os.environ.setdefault(key, value)
        # Frozen too, the imports' objects stay out of the five gc.collect() calls LLM()
        # makes, most of its CPU time before (BENCHMARKS.md). vLLM freezes once started.
        with imports_without_gc():
            import torch
            from vllm import LLM

        if threads:
            torch.set_num_threads(threads)
        kwargs: dict[str, Any] = dict(
            model=model_path, dtype=config_dtype(model_path) if dtype == "auto" else dtype,
            enforce_eager=enforce_eager, seed=seed,
            tensor_parallel_size=tensor_parallel_size, enable_prefix_caching=True,
        )
        if max_model_len:
            kwargs["max_model_len"] = max_model_len
        adapter = adapter_folder(model_path)
        if adapter is not None:
            # A LoRA agent: vLLM serves the frozen base and the agent's adapter on top of it.
            # vLLM allows a few ranks only; the adapter's own rank is kept within the slot.
            rank = adapter_rank(adapter)
            kwargs.update(enable_lora=True, max_loras=lora_slots, max_lora_rank=next(
                r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512, rank) if r >= rank))
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
            kwargs["enable_sleep_mode"] = enable_sleep_mode
        else:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes or cpu_kv_cache_bytes(
                model_path, kwargs["dtype"], max_model_len, kv_cache_sequences, kv_cache_tokens))
            # A step's prompt tokens past vLLM's per-step budget (4096) are prefilled in
            # chunks, and its CPU sampler cannot resume a seeded request's generator there:
            # "CPU Generator does not use offset" (e.g. 8 prompts x 8 generations x 120
            # tokens; comlrl 1.4.3 trains them). Whole prompts per step, then.
            kwargs["enable_chunked_prefill"] = False
        self.llm = LLM(**kwargs)
        self.adapters = AdapterFiles(adapter) if adapter is not None else None
        self.threads = torch.get_num_threads()
        """The engine's OpenMP thread count, fixed by vLLM while it started."""
        self.sampling = sampling
        self.sleeping = False
        self.on_problem = _warn
        """Called with a plain-words text when pushed weights did not all load."""

    def _params(self, n: int, seed: int, max_tokens: int | None = None, **extra: Any):
        from vllm import SamplingParams

        s = self.sampling
        return SamplingParams(
            n=n, seed=seed, temperature=s.temperature, top_p=s.top_p,
            top_k=s.top_k or 0,
            max_tokens=max_tokens or s.max_new_tokens,
            stop_token_ids=list(s.stop_token_ids), **extra,
        )

    def generate(self, requests: list[dict], adapter: Any = None) -> list[list[dict]]:
        """`adapter`: whose LoRA adapter samples them, in an engine serving several (None:
        the engine's own, the one it started with)."""
        self._ready()
        prompts = [{"prompt_token_ids": list(r["prompt_ids"])} for r in requests]
        params = [self._params(int(r["n"]), int(r["seed"]),
                               **({"logprobs": 0} if r.get("logprobs") else {}))
                  for r in requests]
        outs = self.llm.generate(prompts, params, use_tqdm=False,
                                 lora_request=self._adapter(adapter))
        results = []
        for out in outs:
            samples = []
            for comp in sorted(out.outputs, key=lambda c: c.index):
                ids = list(comp.token_ids)
                samples.append({"token_ids": ids})
                if comp.logprobs is not None:
                    samples[-1]["logprobs"] = [step[t].logprob
                                               for step, t in zip(comp.logprobs, ids)]
            results.append(samples)
        return results

    def load_weights(self, state_dict: dict, adapter: Any = None) -> None:
        """Swap weights in place through vLLM's `reload_weights`, then drop stale KV blocks.

        The engine runs in this process, so the worker gets the tensors directly (no pickling
        through collective_rpc, which turns tensors into lists). Without the prefix-cache reset,
        a repeated prompt would reuse KV computed with the old weights.
        """
        self._ready()
        if self.adapters is not None:
            self._load_adapter(state_dict, adapter)
            return
        weights = list(state_dict.items())

        def _reload(worker):
            worker.reload_weights(weights_iterator=iter(weights),
                                  is_checkpoint_format=True)

        check = _ReloadCheck()
        logger = logging.getLogger(_RELOAD_LOGGER)
        logger.addFilter(check)
        try:
            self.llm.collective_rpc(_reload)
        finally:
            logger.removeFilter(check)
        self.llm.reset_prefix_cache()
        if check.layers:
            names = sorted(set(check.layers))
            self.on_problem(
                f"the vLLM engine did not load the pushed weights of {len(check.layers)} "
                f"layer(s) ({', '.join(names)}): it kept their previous weights, so rollouts "
                f"are drawn partly from stale weights. The pushed state dict does not match "
                f"the engine's model (names or shapes).")

    def _adapter(self, key: Any = None) -> Any:
        """The LoRARequest of adapter `key`'s current version (None: a full-weight agent)."""
        if self.adapters is None:
            return None
        from vllm.lora.request import LoRARequest

        lora_id, path = self.adapters.current(key)
        return LoRARequest(f"adapter-{lora_id}", lora_id, path)

    def _load_adapter(self, state_dict: dict, key: Any) -> None:
        """A LoRA agent's push: the new adapter written into a new folder, loaded under a new
        id and name (vLLM's prefix cache keys an adapter's blocks by its name and path, not
        its weights), then the old one removed; loaded now, not at the first request, so a
        bad adapter fails the push and the push's time is the whole cost."""
        old = self.adapters.write(key, state_dict)
        self.llm.llm_engine.add_lora(self._adapter(key))
        if old is not None:
            self.llm.llm_engine.remove_lora(old)
        self.llm.reset_prefix_cache()

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """Log-prob of every token of `token_ids` given the ones before (first token: 0)."""
        self._ready()
        params = self._params(1, 0, max_tokens=1, prompt_logprobs=0)
        out = self.llm.generate([{"prompt_token_ids": list(token_ids)}], params, use_tqdm=False,
                                lora_request=self._adapter())
        plp = out[0].prompt_logprobs
        return [0.0] + [step[t].logprob for step, t in zip(plp[1:], token_ids[1:])]

    def _ready(self) -> None:
        """Awake, and OpenMP in the calling thread at the engine's count. vLLM's CPU attention
        refuses any other count, and a threaded actor (an agent host, workers/roles/agent_host.py)
        runs each call in a pool thread whose count starts from OMP_NUM_THREADS. torch._C's
        setter: vLLM has turned `torch.set_num_threads` into a no-op."""
        import torch

        torch._C.set_num_threads(self.threads)
        self.wake()

    def sleep(self) -> None:
        if not self.sleeping and _has_gpu():
            self.llm.sleep(level=1)
            self.sleeping = True

    def wake(self) -> None:
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False

    def shutdown(self) -> None:
        engine_core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        self.llm = None
        if self.adapters is not None:
            self.adapters.remove()


class AdapterFiles:
    """The folders a vLLM engine loads its LoRA adapters from: one per version of each
    adapter it serves (keyed by agent; None: the one it started with), on tmpfs where there
    is one, the previous version removed once the next is written. The model folder the
    engine started from may be gone by the first request (an actor's packed copy), so its
    adapter is copied here at start. Ids are never reused: vLLM loads an id it has not seen
    afresh. The adapters an engine serves share one config (`lora_engine_groups`)."""

    def __init__(self, source: Path):
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.root = Path(tempfile.mkdtemp(prefix="comlrl-adapter-", dir=shm))
        self.config = (source / ADAPTER_CONFIG).read_bytes()
        self.last_id = 1
        self.versions: dict[Any, tuple[int, str]] = {None: (1, str(self.root / "1"))}
        shutil.copytree(source, self.root / "1")

    def current(self, key: Any) -> tuple[int, str]:
        """(vLLM id, folder) of adapter `key`'s newest version."""
        if key not in self.versions:
            raise KeyError(f"this engine was given no adapter for agent {key} yet")
        return self.versions[key]

    def write(self, key: Any, state_dict: dict) -> int | None:
        """Adapter `key`'s new version; returns the id of the one it replaces, if any."""
        from safetensors.torch import save_file

        self.last_id += 1
        folder = self.root / str(self.last_id)
        folder.mkdir()
        (folder / ADAPTER_CONFIG).write_bytes(self.config)
        save_file({k: v.detach().contiguous() for k, v in state_dict.items()},
                  str(folder / ADAPTER_WEIGHTS), {"format": "pt"})
        old = self.versions.get(key)
        self.versions[key] = (self.last_id, str(folder))
        if old is not None:
            shutil.rmtree(old[1], ignore_errors=True)
        return None if old is None else old[0]

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _ReloadCheck(logging.Filter):
    """Collects vLLM's "<Layer>: Failed to load weights" records of one `reload_weights`.

    A rotary embedding always "fails": its only tensor is a cos/sin cache vLLM computes from
    the config, which no checkpoint holds, and vLLM puts it back as it was. That record is
    dropped; any other layer is one whose pushed weights were not taken."""

    def __init__(self) -> None:
        super().__init__()
        self.layers: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if "Failed to load weights" not in str(record.msg):
            return True
        layer = str(record.args[0]) if isinstance(record.args, tuple) and record.args \
            else record.getMessage().split(":")[0]
        if layer.endswith("RotaryEmbedding"):
            return False
        self.layers.append(layer)
        return True


def _warn(text: str) -> None:
    warnings.warn(text, stacklevel=2)


def check_loaded(model: Any, missing: list[str], unexpected: list[str], what: str) -> None:
    """Refuse a state dict that left a weight of `model` unloaded or held a foreign one. A
    missing key is fine only when its tensor is tied to a loaded one (e.g. lm_head to the
    embedding, which save_pretrained stores once)."""
    tensors = dict(model.state_dict(keep_vars=True))
    loaded = {tensors[k].data_ptr() for k in tensors if k not in set(missing)}
    untied = [k for k in missing if tensors[k].data_ptr() not in loaded]
    if untied or unexpected:
        raise ValueError(f"{what} do not match the model: not loaded {untied[:5]}, unknown "
                         f"{list(unexpected)[:5]}; the checkpoint or weights come from a "
                         f"different architecture.")


def config_dtype(model_path: str) -> str:
    """The dtype the model was saved in: vLLM's own 'auto' turns float32 into bfloat16 on CPU,
    and the engine must compute what the float32 learner computes."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return "auto"
    return str(cfg.get("dtype") or cfg.get("torch_dtype") or "auto")


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def make_engine(name: str, model_path: str, sampling: SamplingSettings, **kwargs: Any):
    """Build the engine `name` ('vllm' or 'hf') for the model folder `model_path`."""
    if name == "vllm":
        return VLLMEngine(model_path, sampling, **kwargs)
    if name == "hf":
        return HFEngine(model_path, sampling, **kwargs)
    raise ValueError(f"rollout_engine must be 'vllm' or 'hf' (got {name!r}).")
