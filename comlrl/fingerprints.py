"""Fingerprints of what a resume must not change: the config, the data, the models, the
tokenizers and the user's callables (reward, transition, formatters), compared on resume.

A callable's fingerprint covers what changes its behaviour (its code, bound arguments,
closure cells, simple globals, object state), never a memory address, so the same callable
has the same fingerprint in a new process.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import inspect
import json
import marshal
import os
import types
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

from comlrl.checkpoint import CheckpointError
from comlrl.digests import file_sha256
from comlrl.lora import ADAPTER_CONFIG, ADAPTER_FOLDER

# The callables fingerprinted by the trainer; skip_callable_fingerprints ignores these keys.
CALLABLE_FINGERPRINT_KEYS = frozenset(
    {"reward_func", "reward_processor", "external_transition", "formatters",
     "centralized_adapter"})

SKIP_CALLABLE_FINGERPRINTS = "MAGRPOConfig(skip_callable_fingerprints=True)"
_SIMPLE = (type(None), bool, int, float, complex, str)
_MAX_DEPTH = 16
# Tensors/arrays above this size are hashed on _SAMPLE evenly spaced elements (plus dtype and
# shape), so a closure over a large model neither copies it to the host nor hashes gigabytes.
_LARGE_BYTES = 64 << 20
_SAMPLE = 1 << 20


def _sha16(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:16]


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', None) or '?'}.{getattr(obj, '__qualname__', None) or type(obj).__qualname__}"


def _code_hash(code: types.CodeType) -> str:
    return _sha16(marshal.dumps(code))


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _is_simple_constant(value: Any) -> bool:
    if isinstance(value, _SIMPLE) or isinstance(value, bytes):
        return True
    if isinstance(value, (tuple, frozenset)):
        return all(_is_simple_constant(v) for v in value)
    return False


class _Describer:
    """Turns a callable and the state it uses into address-free tokens; what cannot be
    described is named in `problems` and replaced by its type's name (stable, but blind)."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self._active: set[int] = set()

    def fail(self, where: str, obj: Any, why: str = "") -> list:
        kind = type(obj).__qualname__
        self.problems.append(f"{where} ({kind}{': ' + why if why else ''})")
        return ["unhashable", _qualname(type(obj))]

    def value(self, obj: Any, where: str, depth: int = 0) -> Any:
        if isinstance(obj, _SIMPLE):
            return [type(obj).__name__, repr(obj)]
        if isinstance(obj, (bytes, bytearray)):
            return [type(obj).__name__, _sha16(bytes(obj))]
        if isinstance(obj, enum.Enum):
            return ["enum", _qualname(type(obj)), obj.name]
        if depth > _MAX_DEPTH:
            return self.fail(where, obj, "nested too deeply")
        if id(obj) in self._active:
            return ["cycle", _qualname(type(obj))]
        self._active.add(id(obj))
        try:
            return self._compound(obj, where, depth + 1)
        except Exception as exc:  # a state_dict() or property that raises, a tensor we can't read
            return self.fail(where, obj, f"{type(exc).__name__}: {exc}")
        finally:
            self._active.discard(id(obj))

    def _compound(self, obj: Any, where: str, depth: int) -> Any:
        if isinstance(obj, (tuple, list)):
            return [type(obj).__name__, [self.value(v, f"{where}[{i}]", depth)
                                         for i, v in enumerate(obj)]]
        if isinstance(obj, (set, frozenset)):
            items = [self.value(v, f"{where}{{}}", depth) for v in obj]
            return [type(obj).__name__, sorted(items, key=lambda t: json.dumps(t))]
        if isinstance(obj, dict):
            items = [[self.value(k, f"{where} key", depth), self.value(v, f"{where}[{k!r}]", depth)]
                     for k, v in obj.items()]
            return ["dict", sorted(items, key=lambda kv: json.dumps(kv[0]))]
        mod = type(obj).__module__ or ""
        if mod.startswith("numpy") and hasattr(obj, "dtype") and hasattr(obj, "tobytes"):
            import numpy as np

            arr = np.asarray(obj)
            if arr.dtype.hasobject:
                return ["ndarray-object", list(arr.shape), self.value(arr.tolist(), where, depth)]
            flat = arr.reshape(-1)
            if arr.nbytes > _LARGE_BYTES:
                flat = flat[np.arange(_SAMPLE, dtype=np.int64) * (flat.size - 1) // (_SAMPLE - 1)]
            return ["ndarray", str(arr.dtype), list(arr.shape),
                    _sha16(np.ascontiguousarray(flat).tobytes())]
        if mod.startswith("torch") and hasattr(obj, "dtype") and hasattr(obj, "detach"):
            import torch

            flat = obj.detach().reshape(-1)
            if flat.numel() * flat.element_size() > _LARGE_BYTES:
                idx = torch.arange(_SAMPLE, dtype=torch.int64, device=flat.device)
                flat = flat[idx * (flat.numel() - 1) // (_SAMPLE - 1)]
            raw = flat.to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
            return ["tensor", str(obj.dtype), list(obj.shape), _sha16(raw)]
        if callable(getattr(obj, "get_vocab", None)) and hasattr(obj, "eos_token"):
            return ["tokenizer", _qualname(type(obj)), fingerprint_tokenizer(obj)]
        if isinstance(obj, functools.partial):
            return ["partial", self.value(obj.func, f"{where}.func", depth),
                    self.value(obj.args, f"{where}.args", depth),
                    self.value(obj.keywords, f"{where}.keywords", depth)]
        if isinstance(obj, types.FunctionType):
            return ["function", self.function(obj, where, depth)]
        if isinstance(obj, types.MethodType):
            return ["method", self.value(obj.__func__, f"{where}.__func__", depth),
                    self.value(obj.__self__, f"{where}.__self__", depth)]
        if isinstance(obj, (types.BuiltinFunctionType, types.BuiltinMethodType)):
            owner = getattr(obj, "__self__", None)
            bound = None if owner is None or isinstance(owner, types.ModuleType) \
                else self.value(owner, f"{where}.__self__", depth)
            return ["builtin", _qualname(obj), bound]
        if isinstance(obj, types.ModuleType):
            return ["module", obj.__name__]
        if isinstance(obj, type):
            return ["class", self.klass(obj)]
        if isinstance(obj, types.CodeType):
            return ["code", _code_hash(obj)]
        return self.instance(obj, where, depth)

    def instance(self, obj: Any, where: str, depth: int) -> Any:
        """An object: its class (source) and state (state_dict() if it has one, else
        __dict__ and __slots__); never its repr, which may hold a memory address."""
        cls = type(obj)
        state_dict = getattr(obj, "state_dict", None)
        if callable(state_dict) and not isinstance(obj, type):
            return ["object", self.klass(cls), self.value(state_dict(), f"{where}.state_dict()",
                                                        depth)]
        state: dict[str, Any] = {}
        has_state = False
        if hasattr(obj, "__dict__"):
            state.update(vars(obj))
            has_state = True
        for klass in cls.__mro__:
            for slot in getattr(klass, "__slots__", ()) or ():
                if isinstance(slot, str) and slot not in ("__dict__", "__weakref__") \
                        and hasattr(obj, slot):
                    state[slot] = getattr(obj, slot)
                    has_state = True
        if not has_state and len(cls.__mro__) > 1 and all(
                "__slots__" in vars(k) for k in cls.__mro__[:-1]):
            has_state = True  # a Python class with empty __slots__ all the way: no state
        if not has_state:
            return self.fail(where, obj, "no __dict__, __slots__ or state_dict()")
        return ["object", self.klass(cls), self.value(state, f"{where}.__dict__", depth)]

    def klass(self, cls: type) -> list:
        """A class by name and source (its own and its bases' from the same package)."""
        top = (cls.__module__ or "").split(".")[0]
        parts = []
        for k in cls.__mro__:
            if (k.__module__ or "").split(".")[0] != top or k.__module__ == "builtins":
                continue
            try:
                parts.append(_sha16(inspect.getsource(k)))
            except (OSError, TypeError):
                codes = sorted((name, _code_hash(f.__code__)) for name, f in vars(k).items()
                               if isinstance(f, types.FunctionType))
                parts.append(_sha16(json.dumps(codes)))
        return [_qualname(cls), parts]

    def function(self, func: types.FunctionType, where: str, depth: int = 0) -> str:
        """`module.qualname:sha(source)` as before, plus (when there are any) a hash of what
        the source does not show: closure cells, defaults, simple globals it reads, and the
        compiled code when there is no source."""
        name = _qualname(func)
        try:
            src = inspect.getsource(func)
        except (OSError, TypeError):
            src = None
        base = f"{name}:{_sha16(src or '')}"
        code = func.__code__
        extras: dict[str, Any] = {}
        if src is None:
            extras["code"] = _code_hash(code)
        if func.__closure__:
            cells = {}
            for var, cell in zip(code.co_freevars, func.__closure__):
                try:
                    content = cell.cell_contents
                except ValueError:
                    cells[var] = ["empty"]
                    continue
                cells[var] = self.value(content, f"{where} closure {var!r}", depth)
            extras["closure"] = cells
        if func.__defaults__:
            extras["defaults"] = self.value(func.__defaults__, f"{where} defaults", depth)
        if func.__kwdefaults__:
            extras["kwdefaults"] = self.value(func.__kwdefaults__, f"{where} defaults", depth)
        scope = getattr(func, "__globals__", {})
        simple = {n: self.value(scope[n], f"{where} global {n}", depth)
                  for n in sorted(_global_names(code))
                  if n in scope and _is_simple_constant(scope[n])}
        if simple:
            extras["globals"] = simple
        if not extras:
            return base
        return f"{base}+{_sha16(json.dumps(extras, sort_keys=True))}"


def fingerprint_callable(func: Callable | None, label: str | None = None,
                         warn: bool = True) -> str | None:
    """A value that changes when what `func` does changes, equal across processes.

    Plain functions: `module.qualname:sha(source)` (as in earlier versions), plus a hash of
    their closure cells, defaults and the simple global constants they read when they have
    any. functools.partial: its func plus args and keywords. Bound methods: the function plus
    the instance's state. Callable objects: their class source plus their state
    (`state_dict()` if they have one, else `__dict__`/`__slots__`). Tensors and arrays are
    hashed by dtype, shape and bytes; containers element by element; never a repr that could
    hold a memory address.

    A part that cannot be described (an object without reachable state, e.g. a C-extension
    handle) is replaced by its type's name, so the value stays stable but cannot see changes
    there; with `warn`, ONE warning names the callable (`label`, e.g. "reward_func") and the
    setting that skips the callable check, MAGRPOConfig(skip_callable_fingerprints=True).
    """
    if func is None:
        return None
    d = _Describer()
    where = label or "callable"
    if isinstance(func, types.FunctionType):
        fp = d.function(func, where)
    else:
        token = d.value(func, where)
        target = func
        while isinstance(target, functools.partial):
            target = target.func
        if isinstance(target, types.MethodType):
            target = target.__func__
        shown = target if isinstance(target, (types.FunctionType, type)) or hasattr(
            target, "__qualname__") else type(target)
        prefix = "partial:" if isinstance(func, functools.partial) else ""
        fp = f"{prefix}{_qualname(shown)}:{_sha16(json.dumps(token))}"
    if d.problems and warn:
        warnings.warn(
            f"{where} {fp.split(':')[0]}: cannot fingerprint {'; '.join(d.problems[:3])}"
            f"{' and more' if len(d.problems) > 3 else ''}. A change there will not be noticed "
            f"when a checkpoint is resumed. If resuming then reports a difference in {where} "
            f"that you made on purpose, {SKIP_CALLABLE_FINGERPRINTS} skips the check of the "
            f"callables.", UserWarning, stacklevel=2)
    return fp


def fingerprint_rows(rows: Sequence[dict] | None) -> str | None:
    if rows is None:
        return None
    h = hashlib.sha256()
    for row in rows:
        h.update(json.dumps(row, sort_keys=True, default=str).encode())
    return f"{len(rows)} rows:{h.hexdigest()[:16]}"


def fingerprint_model_folder(folder: str | os.PathLike) -> str:
    """Hash of a saved model's config and weight files (what from_pretrained would load),
    and of a LoRA agent's adapter subfolder (comlrl.lora.ADAPTER_FOLDER) if it has one."""
    h = hashlib.sha256()
    d = Path(folder)
    files = sorted(d.iterdir())
    if (d / ADAPTER_FOLDER).is_dir():
        files += sorted((d / ADAPTER_FOLDER).iterdir())
    for f in files:
        if f.suffix == ".safetensors" or f.name in ("config.json", ADAPTER_CONFIG):
            h.update(str(f.relative_to(d)).encode())
            h.update(file_sha256(f).encode())
    return h.hexdigest()[:16]


def fingerprint_tokenizer(tokenizer: Any) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    extra = [tokenizer.eos_token, tokenizer.pad_token, getattr(tokenizer, "chat_template", None)]
    return hashlib.sha256(json.dumps([vocab, extra], default=str).encode()).hexdigest()[:16]


def compare_fingerprints(saved: dict, current: dict, resumable: frozenset,
                         skip_callables: bool = False) -> None:
    """Raise CheckpointError naming every setting that differs (with both values).

    `skip_callables` (MAGRPOConfig.skip_callable_fingerprints) ignores the callables' keys
    (CALLABLE_FINGERPRINT_KEYS)."""
    problems = []
    saved_cfg, current_cfg = saved.get("config", {}), current.get("config", {})
    for key in sorted(set(saved_cfg) | set(current_cfg)):
        if key in resumable:
            continue
        a, b = saved_cfg.get(key), current_cfg.get(key)
        if json.dumps(a, default=str) != json.dumps(b, default=str):
            problems.append(f"config.{key}: checkpoint has {a!r}, this run has {b!r}")
    callables_differ = False
    for key in sorted(set(saved) | set(current)):
        if key == "config" or (skip_callables and key in CALLABLE_FINGERPRINT_KEYS):
            continue
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):      # e.g. peft_config.<field>
            problems += [f"{key}.{sub}: checkpoint has {a.get(sub)!r}, this run has "
                         f"{b.get(sub)!r}" for sub in sorted(set(a) | set(b))
                         if a.get(sub) != b.get(sub)]
        elif a != b:
            problems.append(f"{key}: checkpoint has {a!r}, this run has {b!r}")
            callables_differ |= key in CALLABLE_FINGERPRINT_KEYS
    if problems:
        hint = (f"\nIf a callable changed on purpose (or its fingerprint is not stable), "
                f"{SKIP_CALLABLE_FINGERPRINTS} skips the check of the callables."
                if callables_differ else "")
        raise CheckpointError(
            "cannot resume: the run differs from the checkpoint in\n  - " + "\n  - ".join(problems)
            + "\nOnly num_train_epochs, devices/placement, worker counts and logging settings may "
            "change on resume. Restore these settings, or start a new run in an empty "
            "checkpoint_dir." + hint
        )
