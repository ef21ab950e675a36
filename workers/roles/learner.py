"""Learner: one agent's Hugging Face model and AdamW, updated from group advantages.

A plain class (unit-testable without Ray); `workers.ray_calls.start_actor` wraps it in
`ray.remote`. One learner per agent, so agents train in parallel on separate cores or GPUs.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import random
import threading
from pathlib import Path
from typing import Any

from comlrl.loading import load_causal_lm
from comlrl.lora import (
    ADAPTER_FOLDER,
    ADAPTER_WEIGHTS,
    adapter_folder,
    adapter_state_dict,
    load_adapter_state,
    write_adapter_config,
)
from comlrl.magrpo import compute_advantages, pad_batch, policy_loss, token_logprobs
from workers.checkpoint_write import (
    safetensors_hashed,
    safetensors_save_hashed,
    torch_save_hashed,
)
from workers.engines import check_loaded, imports_without_gc
from workers.model_source import model_folder

OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng_state.pt"
TOKENIZER_FILES = ("tokenizer", "special_tokens", "vocab", "merges", "chat_template")


class Learner:
    ray_max_concurrency = 2
    """`saved` waits for a background checkpoint write while the next `update` runs; the
    driver never sends two other calls at once (workers.ray_calls.start_actor reads this)."""

    def __init__(self, agent_index: int, model_source: str | dict, *, learning_rate: float,
                 train_batch_size: int, loss_aggregation: str = "sequence",
                 advantage_mode: str = "mean", advantage_normalization: bool = True,
                 reference_kl_coef: float | None = None, gradient_checkpointing: bool = False,
                 device: str = "auto", threads: int | None = None, take_turns: bool = False):
        with imports_without_gc():
            import torch
            import transformers  # noqa: F401  (its long import, with the collector off)

        # A learner started over for a later train() (`reinit`) begins from the global RNG
        # state a new process has here, so its run matches one in a fresh actor.
        if not hasattr(self, "initial_rng"):
            self.initial_rng = torch.random.get_rng_state()
        torch.random.set_rng_state(self.initial_rng)
        self.threads = threads
        self._own_threads()
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.agent_index = agent_index
        self.device = device
        self.train_batch_size = train_batch_size
        self.loss_aggregation = loss_aggregation
        self.advantage_mode = advantage_mode
        self.advantage_normalization = advantage_normalization
        # Reference KL: a frozen copy of the initial weights (comlrl's reference model).
        self.reference_kl_coef = reference_kl_coef
        self.reference = None
        with model_folder(model_source) as path:      # all of it is loaded in this block
            adapter = adapter_folder(path)
            self.lora = adapter is not None     # only its adapter trains (comlrl/lora.py)
            self.model = load_agent_model(path, adapter, trainable=True)
            self.model.to(device).train()
            if device == "cpu" and not self.lora:
                # The weights are the file mapped copy-on-write: the first AdamW step would
                # fault them in 4 KB at a time (a copy is far cheaper, BENCHMARKS.md), and
                # fresh memory is block-aligned for the checkpoint writes (huge-page aligned
                # in an actor, `THP_MEM_ALLOC_ENABLE`). A LoRA agent's base is never
                # written: it stays mapped, and its adapter is loaded into new memory.
                into_fresh_memory(self.model, self.model.state_dict())
            if gradient_checkpointing:
                # Non-reentrant, torch's recommended form (the reentrant one needs an input
                # that requires grad, and transformers hooks the embeddings to make one).
                self.model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
            if reference_kl_coef is not None:
                self.reference = load_agent_model(path, adapter, trainable=False)
                self.reference.to(device).eval().requires_grad_(False)
            folder = Path(path)
            self.turns = UpdateTurns(folder) if take_turns and self.lora and device == "cpu" \
                else None
            self.tokenizer_files = {  # kept to write beside the weights in every checkpoint
                f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.is_file() and
                f.name.startswith(TOKENIZER_FILES)} if folder.is_dir() else {}
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=learning_rate,
            weight_decay=0.01)
        step_in_backward(self.optimizer)
        gen = self.model.generation_config
        pad = gen.pad_token_id if gen.pad_token_id is not None else self.model.config.pad_token_id
        self.pad_id = int(pad if pad is not None else 0)
        self.version = 0
        self.on_disk: tuple[int, dict] | None = None
        """(version, {file: digest}) of the weight, AdamW and RNG files last saved or loaded,
        while the state is still exactly theirs (`resume` then reads none of them)."""

    def reinit(self, agent_index: int, model_source: str | dict, **settings: Any) -> int:
        """Start over as a new learner built with these arguments would: weights and
        reference from `model_source`, a fresh optimizer, version 0 (a warm actor taken by a
        later train(), workers/driver/actors.py)."""
        Learner.__init__(self, agent_index, model_source, **settings)
        return self.version

    # ------------------------------------------------------------ training

    def update(self, groups: list[dict], shuffle_seed: int) -> dict[str, Any]:
        """One update from `groups` (one per prompt node): mini-batches of train_batch_size.

        Each group is {"prompt_ids": [...], "completions": [[...] x K], "returns": [K],
        "turn": t}, its completions already cut after EOS. Returns become advantages here,
        after the reference-KL penalty when enabled. Groups are shuffled with `shuffle_seed`
        (like comlrl's shuffle, but reproducible) and each mini-batch is ONE padded forward.
        """
        self._own_threads()
        self._wait_write()
        self.on_disk = None
        if self.turns is not None:
            with self.turns:
                return self._update(groups, shuffle_seed)
        return self._update(groups, shuffle_seed)

    def _update(self, groups: list[dict], shuffle_seed: int) -> dict[str, Any]:
        import torch

        kls = self.reference_kls(groups) if self.reference is not None else None
        for i, g in enumerate(groups):
            returns = g["returns"]
            if kls is not None:
                returns = [r - self.reference_kl_coef * kl for r, kl in zip(returns, kls[i])]
            g["advantages"] = compute_advantages(returns, self.advantage_mode,
                                                 self.advantage_normalization)
        # Turn by turn (comlrl updates each turn's nodes separately), shuffled within a turn.
        rng = random.Random(shuffle_seed)
        by_turn: dict[int, list[int]] = {}
        for i, g in enumerate(groups):
            by_turn.setdefault(int(g.get("turn", 0)), []).append(i)
        batches = []
        for turn in sorted(by_turn):
            order = by_turn[turn]
            rng.shuffle(order)
            batches += [order[s:s + self.train_batch_size]
                        for s in range(0, len(order), self.train_batch_size)]
        losses, tokens = [], 0
        for batch_ids in batches:
            batch = [groups[i] for i in batch_ids]
            prompts = [g["prompt_ids"] for g in batch for _ in g["completions"]]
            comps = [c for g in batch for c in g["completions"]]
            adv = torch.tensor([a for g in batch for a in g["advantages"]], dtype=torch.float32,
                               device=self.device)
            ids, attn, target = (t.to(self.device) for t in pad_batch(prompts, comps, self.pad_id))
            self.optimizer.zero_grad(set_to_none=True)
            logits = self.model(input_ids=ids, attention_mask=attn, use_cache=False).logits
            loss = policy_loss(token_logprobs(logits, ids), target, adv,
                               [len(g["completions"]) for g in batch], self.loss_aggregation)
            del logits            # backward needs only log_softmax's output, not the head's
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"agent {self.agent_index}: loss is {loss.item()} (not finite); lower "
                    f"agent_learning_rate or check the rewards."
                )
            loss.backward()               # each parameter's AdamW step runs in here
            losses.append(float(loss.detach()))
            tokens += int(target.sum().item())
        self.version += 1
        out: dict[str, Any] = {"loss": sum(losses) / len(losses), "trained_tokens": tokens,
                               "version": self.version,
                               "optimizer_steps": [int(groups[b[0]].get("turn", 0))
                                                   for b in batches]}  # turn of each step
        if kls is not None:
            per_turn: dict[int, list[float]] = {}
            for g, k in zip(groups, kls):
                per_turn.setdefault(int(g.get("turn", 0)), []).extend(k)
            out["reference_kl"] = {t: sum(v) / len(v) for t, v in per_turn.items()}
        return out

    def _own_threads(self) -> None:
        """OpenMP in the calling thread at this learner's count. An agent host runs its calls
        in pool threads and its engine sets another count in its own calls
        (`workers.engines.VllmEngine._ready`); torch._C's setter, since vLLM has turned
        `torch.set_num_threads` into a no-op in a process where it runs."""
        import torch

        if self.threads:
            torch._C.set_num_threads(self.threads)

    def reference_kls(self, groups: list[dict]) -> list[list[float]]:
        """Sequence KL to the reference of every completion, under the weights that sampled it.

        Schulman's k3 estimator per token, exp(ref - pol) - (ref - pol) - 1, summed over the
        completion (comlrl's definition); batched one group at a time, no gradients.
        """
        import torch

        out = []
        with torch.no_grad():
            for start in range(0, len(groups), self.train_batch_size):
                chunk = groups[start:start + self.train_batch_size]
                prompts = [g["prompt_ids"] for g in chunk for _ in g["completions"]]
                comps = [c for g in chunk for c in g["completions"]]
                ids, attn, target = (t.to(self.device)
                                     for t in pad_batch(prompts, comps, self.pad_id))
                pol = token_logprobs(self.model(input_ids=ids, attention_mask=attn).logits, ids)
                ref = token_logprobs(self.reference(input_ids=ids, attention_mask=attn).logits,
                                     ids)
                diff = ref - pol
                seq_kl = ((torch.exp(diff) - diff - 1.0) * target).sum(dim=1).tolist()
                for g in chunk:
                    out.append(seq_kl[:len(g["completions"])])
                    seq_kl = seq_kl[len(g["completions"]):]
        return out

    def push_state(self) -> dict:
        """What the engines, checkpoints and the hand-back get of this agent: the model's
        state dict, or a LoRA agent's adapter weights alone (PEFT's saved names)."""
        return adapter_state_dict(self.model) if self.lora else self.model.state_dict()

    def get_weights(self) -> dict:
        """CPU tensors for the engines. No copy of CPU tensors here: Ray serializes the return
        value into the object store before this actor runs its next call (the next update),
        so that is the one copy the push needs."""
        return {k: v.detach().to("cpu") for k, v in self.push_state().items()}

    def get_version(self) -> int:
        return self.version

    # ------------------------------------------------------------ checkpoints

    def save(self, folder: str) -> None:
        """Write weights, optimizer state, RNG and version as they are now into `folder` in a
        background thread: a `from_pretrained` folder (weights, config, tokenizer) plus
        optimizer and RNG files. Generation goes on while it writes; `saved` waits for the
        write (the checkpointer's commit does, through Ray), and so does the next update."""
        import torch

        self.saved()                      # one write at a time
        # On the CPU the write reads the live tensors: only `update` and `load` change them,
        # and both first wait for it (`_wait_write`), which is normally long done since it
        # runs while the engines generate the next step. That spares copying weights and
        # AdamW state on the driver's path. From a GPU they are copied first.
        copy = _cpu_copy if self.device != "cpu" else (lambda state: state)
        shared: dict = {}                 # tied weights stay one tensor (save_pretrained)
        weights = {k: shared.setdefault((v.data_ptr(), v.shape), copy(v.detach()))
                   for k, v in self.push_state().items()}
        snapshot = (weights, copy(self.optimizer.state_dict()),
                    {"torch": torch.random.get_rng_state(), "python": random.getstate(),
                     "version": self.version})
        self.write = {"thread": threading.Thread(target=self._write, daemon=True,
                                                 args=(Path(folder), *snapshot)),
                      "files": None, "error": None}
        self.write["thread"].start()

    def _write(self, out: Path, weights: dict, optimizer: dict, rng: dict) -> None:
        try:
            # Not parents=True: a staging folder removed meanwhile (`abort`) stays removed.
            out.mkdir(exist_ok=True)
            # Weights and optimizer state (2/3 of the bytes) are written past the page cache
            # and hashed on the way, so the checkpointer records these digests instead of
            # reading the files back; the writes also leave the GIL to a colocated engine.
            digests: dict[str, str] = {}
            if self.lora:                 # PEFT's adapter folder: config and weights
                write_adapter_config(self.model.peft_config["default"], out)
                digests[ADAPTER_WEIGHTS] = safetensors_save_hashed(
                    weights, str(out / ADAPTER_WEIGHTS), {"format": "pt"})
            else:
                with safetensors_hashed(digests):
                    self.model.save_pretrained(out, state_dict=weights,
                                               safe_serialization=True)
            for name, data in self.tokenizer_files.items():
                # Tokenizer files travel with the weights so the folder loads on its own.
                (out / name).write_bytes(data)
            digests.update({name: torch_save_hashed(state, out / name)
                            for name, state in ((OPTIMIZER_FILE, optimizer), (RNG_FILE, rng))})
            self.on_disk = (rng["version"], digests)
            self.write["files"] = {p.name: digests.get(p.name) for p in sorted(out.iterdir())}
        except BaseException as exc:  # noqa: BLE001 - raised by `saved`
            self.write["error"] = exc

    def _wait_write(self) -> None:
        """Before the weights or AdamW state change in place: the write `save` started may
        still be reading them (its errors are raised by `saved`)."""
        write = getattr(self, "write", None)
        if write is not None:
            write["thread"].join()

    def saved(self) -> dict[str, str | None] | None:
        """Wait for the write `save` started; {name: digest, or None if not hashed while
        written} of the files it wrote (None if no write was started). Raises what the write
        raised, e.g. a full disk's OSError."""
        write = getattr(self, "write", None)
        if write is None:
            return None
        write["thread"].join()
        self.write = None
        if write["error"] is not None:
            raise write["error"]
        return write["files"]

    def resume(self, folder: str, files: dict[str, str]) -> tuple[int, bool]:
        """`load` a checkpoint's `folder` (`files`: the checkpoint's recorded digests, already
        verified, by path within it) unless this learner's state is still exactly what it
        wrote there or loaded from there: then only the RNG is read. The seed example's resume
        continues from the checkpoint its first train() just wrote (76.6M: 1.84 GB not read
        again). Returns the version and whether the state was kept."""
        if not self.holds(Path(folder).name, files):
            self.load(folder)
            self.on_disk = (self.version, _state_files(Path(folder).name, files))
            return self.version, False
        self._load_rng(Path(folder))
        return self.version, True

    def holds(self, name: str, files: dict[str, str]) -> bool:
        """Whether the state is still exactly that of the weight, AdamW and RNG files under
        `name`/ in `files` (a checkpoint's recorded digests by path): written or loaded
        from there, with no update since."""
        self._wait_write()
        recorded = _state_files(name, files)
        version, mine = self.on_disk or (None, {})
        return version == self.version and bool(recorded) and mine.items() >= recorded.items()

    def load(self, folder: str) -> int:
        """Restore weights, optimizer state, RNG and version from a folder written by `save`."""
        import torch
        from safetensors.torch import load_file

        self._wait_write()
        self.on_disk = None
        src = Path(folder)
        what = f"checkpoint {src} (agent {self.agent_index})"
        if self.lora:
            # A checkpoint's adapter, or that of a manual save's initial state (its models'
            # folders, workers/driver/actors.save_model_folder).
            file = src / ADAPTER_WEIGHTS
            if not file.is_file():
                file = src / ADAPTER_FOLDER / ADAPTER_WEIGHTS
            load_adapter_state(self.model, load_file(str(file)), what)
        else:
            state: dict[str, Any] = {}
            for f in sorted(src.glob("*.safetensors")):
                state.update(load_file(str(f)))
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            check_loaded(self.model, missing, unexpected, what)
        saved = torch.load(src / OPTIMIZER_FILE, weights_only=False, mmap=True)
        self.optimizer.load_state_dict(_into_current(self.optimizer.state_dict(), saved))
        self.version = self._load_rng(src)
        return self.version

    @staticmethod
    def _load_rng(folder: Path) -> int:
        """Set torch's and Python's RNG state from the folder's RNG file; its version."""
        import torch

        rng = torch.load(folder / RNG_FILE, weights_only=False)
        torch.random.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        return int(rng["version"])


def load_agent_model(path: str, adapter: Path | None, trainable: bool) -> Any:
    """The fp32 model of a folder, with its LoRA adapter on top if `adapter` is its adapter
    subfolder (only the adapter's weights then require grad when `trainable`)."""
    import torch

    model = load_causal_lm(path, dtype=torch.float32)
    if adapter is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(adapter), is_trainable=trainable)


def step_in_backward(optimizer: Any) -> None:
    """Run `optimizer`'s step for each parameter as soon as backward has its gradient, then
    drop that gradient: the gradients of the whole model never exist at once, and none is
    kept between updates (4 bytes per parameter less at the update's peak and after it).

    The update computes no global gradient norm (no clipping), and AdamW updates each
    parameter from its own gradient and state alone, so this is the very same arithmetic as
    one `step()` after backward (tests/test_learner_memory.py compares them bit for bit).
    A parameter is used by nothing backward still needs once its gradient is complete (the
    hook fires after the last accumulation, tied weights included), so stepping it then
    changes no other gradient; an in-place change autograd still needed would raise."""
    group = optimizer.param_groups[0]
    everyone = group["params"]
    if len(optimizer.param_groups) != 1:
        raise ValueError("step_in_backward takes an optimizer with one parameter group")

    def step(param: Any) -> None:
        group["params"] = [param]         # step() visits this parameter alone
        try:
            optimizer.step()
        finally:
            group["params"] = everyone
        param.grad = None

    for param in everyone:
        param.register_post_accumulate_grad_hook(step)


def _state_files(name: str, files: dict[str, str]) -> dict[str, str]:
    """{file: digest} of the weight, AdamW and RNG files under `name`/ in `files`."""
    prefix = f"{name}/"
    mine = {rel[len(prefix):]: digest for rel, digest in files.items() if rel.startswith(prefix)}
    return {file: digest for file, digest in mine.items()
            if file.endswith(".safetensors") or file in (OPTIMIZER_FILE, RNG_FILE)}


def into_fresh_memory(model: Any, weights: dict) -> None:
    """Give each weight of `model` newly allocated memory, filled from `weights` (a state dict
    with the same names and shapes; anything else goes to a strict `load_state_dict`, which
    names the difference). `from_pretrained` maps the safetensors file copy-on-write, so
    writing into a loaded weight faults page by page, far slower than a fresh copy
    (BENCHMARKS.md). Tied weights stay one tensor. Used on a CPU learner's weights at start."""
    import torch

    current = model.state_dict(keep_vars=True)
    if current.keys() != weights.keys() or any(
            current[k].shape != w.shape for k, w in weights.items()):
        model.load_state_dict(weights)
        return
    done: set[int] = set()
    with torch.no_grad():
        for name, tensor in current.items():
            if id(tensor) not in done:
                done.add(id(tensor))
                fresh = torch.empty_like(tensor)
                fresh.copy_(weights[name])
                tensor.data = fresh


def _into_current(current: dict, saved: dict) -> dict:
    """`saved`, an optimizer state dict mapped from its file (torch.load(mmap=True)), with
    each tensor copied into the optimizer's `current` one of the same name and shape (a warm
    learner's, whose memory is already faulted in, several times faster than new memory for
    the seed example's resume: BENCHMARKS.md), else into fresh memory. No tensor stays
    mapped: AdamW writes its state in place, and each page of a private file mapping would
    fault and be copied on its first write."""
    import torch

    state = current.get("state", {})
    for index, entry in saved.get("state", {}).items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                mine = state.get(index, {}).get(key)
                same = isinstance(mine, torch.Tensor) and mine.shape == value.shape \
                    and mine.dtype == value.dtype
                entry[key] = mine.copy_(value) if same else value.clone()
    return saved


def _cpu_copy(value: Any) -> Any:
    """`value` (an optimizer state dict) with every tensor copied to the CPU."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu_copy(v) for v in value)
    return value


class UpdateTurns:
    """LoRA learners of one base on one machine's CPU update one at a time (`take_turns`):
    each holds an update's working memory, which glibc keeps after it (`ENGINE_ENV`), so
    four such learners held four; taking turns, each gives it back (`malloc_trim`) before the
    next begins. The turn is an exclusive `flock` on the base weights file, which the group's
    folders hard-link (`workers.driver.actors.save_models`): learners loaded from one
    file contend, others (another base, another machine's copy) never do; a killed learner's
    lock goes with its process. The cores are no loss: the group's learners run at the
    cores one update gets (`workers.driver.session`)."""

    def __init__(self, folder: Path):
        base = sorted(folder.glob("*.safetensors"))[0]
        self.fd = os.open(base, os.O_RDONLY)      # kept: the file may be removed meanwhile

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: Any) -> None:
        try:
            trim = getattr(ctypes.CDLL(None), "malloc_trim", None)     # glibc's
            if trim is not None:
                trim(0)
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def __del__(self) -> None:
        os.close(self.fd)

