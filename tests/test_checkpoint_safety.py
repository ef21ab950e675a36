"""Checkpoint folders we provably own, crash-safe commits, full disks, callable fingerprints.

Everything here runs on real folders with real safetensors/torch files, through the real
Checkpointer class (without Ray: `workers.ray_calls.start_actor` only wraps it in `ray.remote`).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import subprocess
import sys
import threading
import xxhash
import warnings
from pathlib import Path

import pytest

from comlrl import checkpoint as ck
from comlrl.checkpoint import (
    CheckpointError, CheckpointWriteError, list_checkpoints, read_checkpoint_metadata,
    verify_checksums,
)
from comlrl.checkpoint_dir import (
    check_checkpoint_dir, check_free_space, clean_leftovers, is_disk_full,
)
from comlrl.fingerprints import compare_fingerprints, fingerprint_callable
from workers.roles.checkpointer import Checkpointer

ROOT = Path(__file__).resolve().parents[1]
RUN_A, RUN_B = "run-a-0001", "run-b-0002"


# ------------------------------------------------------------------ helpers


def _save_agent(folder: Path, n_floats: int, seed: int = 0) -> None:
    """What a learner's `save` writes: safetensors weights, a torch optimizer file, a config."""
    import torch
    from safetensors.torch import save_file

    from workers.checkpoint_write import torch_save_hashed

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    save_file({"w": torch.randn(n_floats, generator=g)}, str(folder / "model.safetensors"))
    torch_save_hashed({"state": {0: {"exp_avg": torch.randn(n_floats // 4, generator=g)}}},
                      folder / "optimizer.pt")
    (folder / "config.json").write_text(json.dumps({"n": n_floats}))


def _write(cp: Checkpointer, epoch: int, n_floats: int = 1000, seed: int = 0) -> Path:
    staging = Path(cp.begin(epoch))
    _save_agent(staging / "agent_0", n_floats, seed)
    meta = {"env_step": epoch * 4, "epoch": epoch, "run_uid": cp.run_uid}
    return Path(cp.commit(epoch, meta))


def _hf_checkpoint(d: Path, n: int = 500) -> Path:
    """A Hugging Face Trainer checkpoint sharing the folder: not ours."""
    p = d / f"checkpoint-{n}"
    _save_agent(p, 256)
    (p / "trainer_state.json").write_text(json.dumps({"global_step": n}))
    return p


def _tree(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ A. ownership


def test_fresh_start_refuses_a_folder_with_user_files_and_cleanup_never_touches_them(tmp_path):
    d = tmp_path / "ckpt"
    (d / ".staging-paper").mkdir(parents=True)
    (d / ".staging-paper" / "draft.tex").write_text("\\section{Intro}")
    (d / ".trash-photos").mkdir()
    (d / ".trash-photos" / "cat.jpg").write_bytes(b"\xff\xd8jpeg")
    before = _tree(d)
    with pytest.raises(CheckpointError) as err:
        check_checkpoint_dir(d, None)
    msg = str(err.value)
    assert f"checkpoint_dir {d}" in msg and ".staging-paper/" in msg and "empty" in msg
    assert clean_leftovers(d, None) == [] and clean_leftovers(d, RUN_A) == []
    Checkpointer(str(d), 1, RUN_A).clean(fresh_start=True)
    assert _tree(d) == before


def test_fresh_start_accepts_missing_empty_and_comlrl_leftovers_only(tmp_path):
    check_checkpoint_dir(tmp_path / "missing", None)
    (tmp_path / "empty").mkdir()
    check_checkpoint_dir(tmp_path / "empty", None)
    # A crash of an earlier run before its first checkpoint: its staging folder and journal.
    d = tmp_path / "ckpt"
    old = Checkpointer(str(d), None, RUN_B)
    _save_agent(Path(old.begin(1)) / "agent_0", 100)
    ck.write_journal(d, "wandb-id", 3)
    check_checkpoint_dir(d, None)
    removed = Checkpointer(str(d), None, RUN_A).clean(fresh_start=True)
    assert removed == [".staging-checkpoint-1"]
    assert sorted(p.name for p in d.iterdir()) == [ck.JOURNAL]


@pytest.mark.parametrize("thing", ["checkpoint", "wandb", "file"])
def test_fresh_start_refuses_checkpoints_wandb_and_other_files(tmp_path, thing):
    d = tmp_path / "ckpt"
    if thing == "checkpoint":
        _write(Checkpointer(str(d), None, RUN_B), 1)
    elif thing == "wandb":
        (d / "wandb" / "offline-run-x").mkdir(parents=True)
    else:
        d.mkdir()
        (d / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError) as err:
        check_checkpoint_dir(d, None)
    msg = str(err.value)
    assert str(d) in msg
    if thing == "checkpoint":
        assert RUN_B in msg and f"resume_from_checkpoint={d / 'checkpoint-1'}" in msg
    else:
        assert ("wandb/" if thing == "wandb" else "notes.txt") in msg


def test_foreign_checkpoint_n_is_refused_unlisted_and_never_pruned(tmp_path):
    d = tmp_path / "ckpt"
    cp = Checkpointer(str(d), 1, RUN_A)
    _write(cp, 1)
    hf = _hf_checkpoint(d, 500)
    hf_files = _tree(hf)
    assert [p.name for p in list_checkpoints(d)] == ["checkpoint-1"]
    meta = read_checkpoint_metadata(d / "checkpoint-1")
    for resume_meta in (None, meta):
        with pytest.raises(CheckpointError, match="checkpoint-500") as err:
            check_checkpoint_dir(d, resume_meta)
        assert str(d) in str(err.value)
    # Pruning (limit 1) removes only this run's older checkpoint, never the foreign one,
    # even though its number is the highest.
    _write(cp, 2)
    assert sorted(p.name for p in d.iterdir()) == ["checkpoint-2", "checkpoint-500"]
    assert _tree(hf) == hf_files


def test_unreadable_foreign_folder_is_refused_not_skipped(tmp_path):
    d = tmp_path / "ckpt"
    _write(Checkpointer(str(d), None, RUN_A), 1)
    bad = d / "checkpoint-7"
    bad.mkdir()
    (bad / "metadata.json").write_text("{not json")
    meta = read_checkpoint_metadata(d / "checkpoint-1")
    with pytest.raises(CheckpointError, match="checkpoint-7"):
        check_checkpoint_dir(d, meta)


def test_resume_refuses_checkpoints_and_leftovers_of_another_run(tmp_path):
    d = tmp_path / "ckpt"
    _write(Checkpointer(str(d), None, RUN_A), 1)
    meta = read_checkpoint_metadata(d / "checkpoint-1")
    check_checkpoint_dir(d, meta)  # only this run's: fine
    (d / "notes.txt").write_text("tolerated next to this run's checkpoints")
    check_checkpoint_dir(d, meta)
    Checkpointer(str(d), None, RUN_B).begin(3)  # another run's leftover
    with pytest.raises(CheckpointError) as err:
        check_checkpoint_dir(d, meta)
    assert RUN_B in str(err.value) and RUN_A in str(err.value) and str(d) in str(err.value)
    # ...and another run's whole checkpoint.
    (d / ".staging-checkpoint-3").rename(tmp_path / "moved")
    _write(Checkpointer(str(d), None, RUN_B), 2)
    with pytest.raises(CheckpointError, match="checkpoint-2 \\(run run-b"):
        check_checkpoint_dir(d, meta)


def test_resume_into_a_folder_without_this_run_applies_the_fresh_rules(tmp_path):
    src = tmp_path / "src"
    _write(Checkpointer(str(src), None, RUN_A), 1)
    meta = read_checkpoint_metadata(src / "checkpoint-1")
    d = tmp_path / "home"
    d.mkdir()
    (d / "thesis.pdf").write_bytes(b"%PDF")
    with pytest.raises(CheckpointError, match="thesis.pdf"):
        check_checkpoint_dir(d, meta)


def test_pruning_and_cleanup_touch_only_this_runs_folders(tmp_path):
    d = tmp_path / "ckpt"
    a = Checkpointer(str(d), None, RUN_A)
    for e in (1, 2):
        _write(a, e)
    b = Checkpointer(str(d), 1, RUN_B)
    Path(b.begin(9))  # B's staging leftover
    _write(b, 3)
    _write(b, 4)  # prunes B's checkpoint-3 only
    names = sorted(p.name for p in d.iterdir())
    assert names == [".staging-checkpoint-9", "checkpoint-1", "checkpoint-2", "checkpoint-4"]
    assert [p.name for p in list_checkpoints(d, RUN_A)] == ["checkpoint-1", "checkpoint-2"]
    assert clean_leftovers(d, RUN_A) == []
    assert clean_leftovers(d, RUN_B) == [".staging-checkpoint-9"]
    assert ck.prune_checkpoints(d, RUN_A, 1) == ["checkpoint-1"]
    assert sorted(p.name for p in d.iterdir()) == ["checkpoint-2", "checkpoint-4"]


def test_begin_refuses_a_staging_name_held_by_something_not_ours(tmp_path):
    d = tmp_path / "ckpt"
    (d / ".staging-checkpoint-1").mkdir(parents=True)
    (d / ".staging-checkpoint-1" / "keep.txt").write_text("user")
    with pytest.raises(CheckpointError, match="not this run's"):
        Checkpointer(str(d), None, RUN_A).begin(1)
    assert (d / ".staging-checkpoint-1" / "keep.txt").read_text() == "user"


def test_begin_takes_over_the_empty_staging_folder_a_killed_begin_left(tmp_path):
    """A checkpointer killed inside `begin`, after its mkdir and before its marker, leaves
    an unmarked staging folder holding nothing (or only the marker's temporary file); the
    restarted checkpointer's `begin` takes it over instead of refusing it (seen in
    test_scale's learner-and-checkpointer heal, where `ray.kill` landed inside `begin`)."""
    d = tmp_path / "ckpt"
    (d / ".staging-checkpoint-1").mkdir(parents=True)
    (d / ".staging-checkpoint-2").mkdir()
    (d / ".staging-checkpoint-2" / (ck.MARKER + ".tmp")).write_text("{")
    cp = Checkpointer(str(d), None, RUN_A)
    for epoch in (1, 2):
        staging = Path(cp.begin(epoch))
        assert sorted(p.name for p in staging.iterdir()) == [ck.MARKER]


def test_checkpoints_carry_the_marker_and_keep_the_metadata_fields(tmp_path):
    d = tmp_path / "ckpt"
    final = _write(Checkpointer(str(d), None, RUN_A), 1)
    assert ck.read_owner(final) == RUN_A
    marker = json.loads((final / ck.MARKER).read_text())
    assert marker == {"format": ck.FORMAT, "run_uid": RUN_A}
    meta = read_checkpoint_metadata(final)
    assert meta["format"] == ck.FORMAT and meta["format_version"] == ck.FORMAT_VERSION
    assert meta["run_uid"] == RUN_A and meta["env_step"] == 4 and meta["epoch"] == 1
    assert set(meta["files"]) == {"agent_0/model.safetensors", "agent_0/optimizer.pt",
                                  "agent_0/config.json"}
    verify_checksums(final)
    assert not (final / "driver_state.pt").exists()


def test_verify_reads_files_in_parallel_and_names_the_first_changed_file_by_name(tmp_path):
    """verify_checksums hashes the files in threads; whatever finishes first, the error
    names the first changed file in name order, and a missing file is named before any
    hashing starts."""
    names = [f"agent_{a}/{f}" for a in range(3) for f in ("a.bin", "b.bin", "c.json")]
    for i, rel in enumerate(names):
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_bytes(os.urandom(1000 + 100_000 * (i % 3)))
    meta = {"files": {rel: ck.file_digest(tmp_path / rel) for rel in names}}
    verify_checksums(tmp_path, meta)
    for rel in ("agent_2/a.bin", "agent_1/c.json"):   # the later name is the smaller file
        with open(tmp_path / rel, "r+b") as f:
            f.write(b"changed")
    with pytest.raises(CheckpointError, match="agent_1/c.json changed since it was written"):
        verify_checksums(tmp_path, meta)
    (tmp_path / "agent_2" / "b.bin").unlink()
    with pytest.raises(CheckpointError, match="is missing agent_2/b.bin"):
        verify_checksums(tmp_path, meta)


def _cached_pages(path: Path) -> tuple[int, int]:
    """(pages of `path` in the page cache, pages of the file), from mincore(2)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    try:
        assert libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
    finally:
        libc.munmap(addr, size)
    return sum(v & 1 for v in vec), pages


def test_verify_reads_past_the_page_cache_and_reads_ordinarily_where_o_direct_is_refused(
        tmp_path):
    """verify_checksums(direct=True) (a resume whose warm learners hold the checkpoint and
    read none of it) reads with O_DIRECT: files out of the page cache stay out of it
    (mincore), where the ordinary read (the default: the learners read the files next) fills
    it, each page fresh guest memory (1.7 CPU-s per GB here, BENCHMARKS.md). Sizes that are
    not whole blocks, and files larger than the read buffer, hash as xxhash hashes their
    bytes. On tmpfs, which refuses O_DIRECT, the same files verify through ordinary reads,
    and a changed byte is still caught."""
    import tempfile

    sizes = {"agent_0/a.bin": 3 * 4096 + 123, "agent_0/b.bin": (20 << 20) + 7,
             "c.json": 10}
    data = {rel: os.urandom(n) for rel, n in sizes.items()}
    meta = {"files": {rel: "xxh3_128:" + xxhash.xxh3_128(b).hexdigest()
                      for rel, b in data.items()}}
    shm = tempfile.TemporaryDirectory(dir="/dev/shm")
    for root in (tmp_path, Path(shm.name)):
        for rel, b in data.items():
            (root / rel).parent.mkdir(exist_ok=True)
            with open(root / rel, "wb") as f:
                f.write(b)
                f.flush()
                os.fsync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    big = tmp_path / "agent_0" / "b.bin"
    assert _cached_pages(big)[0] == 0, "the page cache kept the file; nothing to measure"
    verify_checksums(tmp_path, meta, direct=True)
    assert all(_cached_pages(tmp_path / rel)[0] == 0 for rel in sizes)
    verify_checksums(tmp_path, meta)
    cached, pages = _cached_pages(big)
    # Not every page: this host's kernel (DAMON, pageout of unmapped page cache) may drop a
    # few in the moment between the read and mincore (5114 of 5121 once in 25 runs).
    assert cached >= 0.9 * pages
    verify_checksums(shm.name, meta, direct=True)
    with open(Path(shm.name) / "agent_0" / "b.bin", "r+b") as f:
        # Flipped, not overwritten: a random byte equals any given one once in 256 runs.
        f.seek(12 << 20)
        byte = f.read(1)[0] ^ 1
        f.seek(12 << 20)
        f.write(bytes([byte]))
    with pytest.raises(CheckpointError, match="agent_0/b.bin changed since it was written"):
        verify_checksums(shm.name, meta, direct=True)
    shm.cleanup()


def test_files_are_recorded_with_xxh3_and_version_1_sha256_checkpoints_still_verify(tmp_path):
    """Format 2 records "xxh3_128:<hex>" for every file, each the hash of the file's bytes
    (computed here with xxhash itself). A format-1 checkpoint (bare sha256 digests) is still
    read and verified, and a changed byte is refused under either scheme, naming the file; a
    digest of a kind this code does not know is refused with what to do."""
    final = _write(Checkpointer(str(tmp_path / "ckpt"), None, RUN_A), 1)
    meta = read_checkpoint_metadata(final)
    assert meta["format_version"] == 2 and meta["files"]
    for rel, digest in meta["files"].items():
        assert digest == "xxh3_128:" + xxhash.xxh3_128((final / rel).read_bytes()).hexdigest()

    raw = json.loads((final / ck.METADATA).read_text())
    raw["format_version"] = 1
    raw["files"] = {rel: hashlib.sha256((final / rel).read_bytes()).hexdigest()
                    for rel in raw["files"]}
    (final / ck.METADATA).write_text(json.dumps(raw))
    verify_checksums(final)
    weights = final / "agent_0" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="agent_0/model.safetensors changed since"):
        verify_checksums(final)
    raw["format_version"] = 2
    raw["files"] = {rel: ck.file_digest(final / rel) for rel in raw["files"]}
    (final / ck.METADATA).write_text(json.dumps(raw))
    verify_checksums(final)
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="agent_0/model.safetensors changed since"):
        verify_checksums(final)
    raw["files"]["agent_0/model.safetensors"] = "md5:0123"
    (final / ck.METADATA).write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="md5:0123.*does not know.*upgrade comlrl-split"):
        verify_checksums(final)


def test_legacy_checkpoint_without_marker_is_ours_by_metadata(tmp_path):
    d = tmp_path / "ckpt"
    cp = Checkpointer(str(d), 1, RUN_A)
    first = _write(cp, 1)
    (first / ck.MARKER).unlink()  # as written before markers existed
    assert list_checkpoints(d, RUN_A) == [first] and ck.read_owner(first) == RUN_A
    check_checkpoint_dir(d, read_checkpoint_metadata(first))
    _write(cp, 2)
    assert [p.name for p in d.iterdir()] == ["checkpoint-2"]


# ------------------------------------------------------------------ A. crashes mid-commit


def test_crash_between_the_two_renames_restores_the_only_whole_copy(tmp_path):
    d = tmp_path / "ckpt"
    cp = Checkpointer(str(d), None, RUN_A)
    _write(cp, 1)
    _write(cp, 2, seed=1)
    old = _tree(d / "checkpoint-2")
    # Re-doing epoch 2; the process dies after checkpoint-2 -> .trash-checkpoint-2 and before
    # .staging-checkpoint-2 -> checkpoint-2 (a real kill in a child process).
    script = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
from pathlib import Path
from tests.test_checkpoint_safety import _save_agent
from workers.roles.checkpointer import Checkpointer
real = os.replace
def replace(src, dst):
    real(src, dst)
    if Path(src).name == "checkpoint-2":
        os._exit(9)
os.replace = replace
cp = Checkpointer({str(d)!r}, None, {RUN_A!r})
_save_agent(Path(cp.begin(2)) / "agent_0", 1000, 7)
cp.commit(2, {{"epoch": 2, "run_uid": {RUN_A!r}}})
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr[-2000:]
    assert sorted(p.name for p in d.iterdir()) == [
        ".staging-checkpoint-2", ".trash-checkpoint-2", "checkpoint-1"]
    assert list_checkpoints(d) == [d / "checkpoint-1"]
    # The next start (check, then clean) restores it instead of deleting it.
    check_checkpoint_dir(d, read_checkpoint_metadata(d / "checkpoint-1"))
    assert cp.clean() == [".staging-checkpoint-2"]
    assert sorted(p.name for p in d.iterdir()) == ["checkpoint-1", "checkpoint-2"]
    assert _tree(d / "checkpoint-2") == old
    verify_checksums(d / "checkpoint-2")


def test_half_deleted_folders_stay_ours_and_are_cleaned(tmp_path):
    d = tmp_path / "ckpt"
    cp = Checkpointer(str(d), None, RUN_A)
    for e in (1, 2, 3):
        _write(cp, e)
    # A prune interrupted after metadata.json went: still marked, no longer listed, cleaned.
    (d / "checkpoint-1" / ck.METADATA).unlink()
    (d / "checkpoint-1" / "agent_0" / "optimizer.pt").unlink()
    # A trash copy whose deletion had begun is not whole: removed, not restored.
    os.replace(d / "checkpoint-3", d / ".trash-checkpoint-3")
    (d / ".trash-checkpoint-3" / ck.METADATA).unlink()
    assert [p.name for p in list_checkpoints(d)] == ["checkpoint-2"]
    check_checkpoint_dir(d, read_checkpoint_metadata(d / "checkpoint-2"))
    assert sorted(cp.clean()) == [".trash-checkpoint-3", "checkpoint-1"]
    assert [p.name for p in d.iterdir()] == ["checkpoint-2"]


def test_kill_in_before_publish_keeps_earlier_checkpoints(tmp_path):
    """The hook that replaces COMLRL_CHECKPOINT_PAUSE_S: the staged folder is complete when it
    runs; a kill there leaves checkpoint-1 whole and a staging folder the next start cleans."""
    d = tmp_path / "ckpt"
    cp = Checkpointer(str(d), None, RUN_A)
    _write(cp, 1)
    seen = {}

    def hook(staging: Path) -> None:
        seen["meta"] = (staging / ck.METADATA).is_file()
        seen["published"] = (d / "checkpoint-2").exists()

    _write(Checkpointer(str(d), None, RUN_A, before_publish=hook), 2)
    assert seen == {"meta": True, "published": False}
    script = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
from pathlib import Path
from tests.test_checkpoint_safety import _save_agent
from workers.roles.checkpointer import Checkpointer
cp = Checkpointer({str(d)!r}, None, {RUN_A!r}, before_publish=lambda staging: os._exit(9))
_save_agent(Path(cp.begin(3)) / "agent_0", 1000, 3)
cp.commit(3, {{"epoch": 3, "run_uid": {RUN_A!r}}})
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr[-2000:]
    assert [p.name for p in list_checkpoints(d)] == ["checkpoint-1", "checkpoint-2"]
    assert (d / ".staging-checkpoint-3" / ck.METADATA).is_file()
    assert cp.clean() == [".staging-checkpoint-3"]
    for name in ("checkpoint-1", "checkpoint-2"):
        verify_checksums(d / name)


def test_commit_takes_no_driver_state_and_production_reads_no_pause_variable():
    # Once a class has been made a Ray actor in this process, Ray adds `_ray_trace_ctx` to
    # its methods' signatures (as earlier tests in the same session do).
    params = [p for p in inspect.signature(Checkpointer.commit).parameters
              if p != "_ray_trace_ctx"]
    # agent_files: what each learner's background write reports (`Learner.saved`), which
    # Ray hands to the commit once every write is done.
    assert params == ["self", "epoch", "metadata", "agent_files"]
    for f in (ROOT / "workers" / "roles" / "checkpointer.py", ROOT / "comlrl" / "checkpoint.py"):
        text = f.read_text()
        assert "COMLRL_CHECKPOINT_PAUSE_S" not in text and "os.environ" not in text


# ------------------------------------------------------------------ B2. hashed writes


def _direct_io_works(folder: Path) -> bool:
    try:
        fd = os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except (OSError, AttributeError):
        return False
    os.close(fd)
    return True


@pytest.mark.parametrize("direct", [True, False])
def test_a_hashed_write_is_exactly_the_bytes_given_and_its_digest_is_their_xxh3(tmp_path,
                                                                                direct):
    """Files of awkward lengths (empty, one byte, around the 4096-byte block and the 8 MiB
    buffer), written in pieces of any size: the file holds exactly those bytes, past the
    page cache where the disk allows it, and the digest is the xxh3-128 of the bytes, as
    `file_digest` reads it back from the file."""
    from workers.checkpoint_write import BUFFER_BYTES, HashedWriter

    rng = __import__("random").Random(0)
    for length in (0, 1, 4095, 4096, 4097, BUFFER_BYTES - 1, BUFFER_BYTES + 4096 * 3 + 5):
        data = rng.randbytes(length)
        path = tmp_path / f"f{length}"
        with HashedWriter(path, direct=direct) as f:
            pos = 0
            while pos < length:
                n = rng.choice([1, 7, 4096, 100_000, BUFFER_BYTES + 11])
                assert f.write(memoryview(data)[pos:pos + n]) == len(data[pos:pos + n])
                pos += n
            assert f.tell() == length
        assert f.direct == (direct and _direct_io_works(tmp_path))
        assert path.read_bytes() == data
        assert f.digest == "xxh3_128:" + xxhash.xxh3_128(data).hexdigest() == ck.file_digest(path)


@pytest.mark.parametrize("direct", [True, False])
def test_files_share_one_reused_buffer_and_keep_nothing_of_each_other(tmp_path, direct):
    """One file after another reuse one staging buffer (a new one per file was fresh memory,
    slow on these VMs), files written at once get their own, and a short file written after
    a long one holds only its own bytes, though the buffer still holds the long one's. At
    most KEPT_BUFFERS are kept; the others are unmapped."""
    from comlrl import digests
    from workers import checkpoint_write as cw

    long, short = os.urandom(cw.BUFFER_BYTES - 1), b"short"
    with cw.HashedWriter(tmp_path / "long", direct=direct) as first:
        first.write(long)
    with cw.HashedWriter(tmp_path / "short", direct=direct) as second:
        second.write(short)
        with cw.HashedWriter(tmp_path / "beside", direct=direct) as third:
            third.write(short * 3)
    assert second.buffer is first.buffer and third.buffer is not first.buffer
    assert (tmp_path / "long").read_bytes() == long
    assert (tmp_path / "short").read_bytes() == short
    assert (tmp_path / "beside").read_bytes() == short * 3
    assert second.digest == ck.file_digest(tmp_path / "short", direct=direct)
    assert ck.file_digest(tmp_path / "long", direct=direct) == first.digest
    assert first.buffer in digests._BUFFERS and third.buffer in digests._BUFFERS
    writers = [cw.HashedWriter(tmp_path / f"many{i}", direct=direct)
               for i in range(digests.KEPT_BUFFERS + 2)]
    for w in writers:
        w.__exit__(None)
    assert len(digests._BUFFERS) == digests.KEPT_BUFFERS         # the rest were unmapped
    assert sum(w.buffer.closed for w in writers) == 2


def _addresses_written(monkeypatch) -> list[int]:
    """Record the memory address of every buffer `checkpoint_write` hands to os.write."""
    import numpy as np

    from workers import checkpoint_write as cw

    seen, real_write = [], os.write

    def write(fd, data):
        seen.append(np.frombuffer(memoryview(data).cast("B"), np.uint8).ctypes.data)
        return real_write(fd, data)

    monkeypatch.setattr(cw.os, "write", write)
    return seen


def test_block_aligned_bytes_go_to_disk_from_their_own_memory(tmp_path, monkeypatch):
    """Pieces whose address and file offset are block-aligned are written from where they
    lie (no copy through the buffer); unaligned pieces, tails and pieces that follow a
    buffered remainder go through the buffer. Whatever the mix, the file holds exactly the
    bytes given and the digest is theirs."""
    import mmap

    from comlrl.digests import ALIGN
    from workers.checkpoint_write import BUFFER_BYTES, HashedWriter

    if not _direct_io_works(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    rng = __import__("random").Random(1)
    region = mmap.mmap(-1, 4 * BUFFER_BYTES)              # page-aligned memory
    region[:] = rng.randbytes(len(region))
    whole = memoryview(region)
    base = __import__("numpy").frombuffer(whole, "uint8").ctypes.data
    pieces = [(0, 3 * ALIGN),                        # in place
              (1, 2 * ALIGN),                        # an odd address: buffered
              (ALIGN, BUFFER_BYTES + 2 * ALIGN),     # the buffer's 2 blocks first, then in place
              (3 * ALIGN, 5), (0, 0),                # too short to write in place
              (0, BUFFER_BYTES + 3 * ALIGN + 7),     # an odd file offset: buffered
              (8 * ALIGN, ALIGN - 5)]
    seen = _addresses_written(monkeypatch)
    with HashedWriter(tmp_path / "f") as f:
        for start, length in pieces:
            assert f.write(whole[start:start + length]) == length
    expected = b"".join(bytes(whole[s:s + n]) for s, n in pieces)
    assert (tmp_path / "f").read_bytes() == expected
    assert f.digest == "xxh3_128:" + xxhash.xxh3_128(expected).hexdigest()
    assert base in seen and base + ALIGN in seen       # the two pieces written in place
    assert f.direct
    whole.release()
    region.close()


def test_torch_save_hashed_writes_large_aligned_tensors_from_their_own_memory(tmp_path,
                                                                            monkeypatch):
    """torch.save is asked for block-aligned records, so a page-aligned tensor's bytes go to
    disk from the tensor (as AdamW moments of 2 MB and more do in an actor); torch.load
    reads the file back equal, and torch's alignment setting is back afterwards."""
    import mmap

    import torch
    from torch.utils.serialization import config

    from workers.checkpoint_write import torch_save_hashed

    if not _direct_io_works(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    region = mmap.mmap(-1, 1 << 20)
    moment = torch.frombuffer(region, dtype=torch.float32)
    moment.copy_(torch.randn(moment.numel(), generator=torch.Generator().manual_seed(0)))
    state = {"state": {0: {"exp_avg": moment, "step": torch.tensor(3.0)}}, "lr": 0.5}
    seen = _addresses_written(monkeypatch)
    digest = torch_save_hashed(state, tmp_path / "optimizer.pt")
    assert moment.data_ptr() in seen
    assert config.save.storage_alignment == 64
    back = torch.load(tmp_path / "optimizer.pt")
    assert torch.equal(back["state"][0]["exp_avg"], moment) and back["lr"] == 0.5
    assert digest == ck.file_digest(tmp_path / "optimizer.pt")
    del moment, back
    region.close()


def test_a_hashed_write_goes_on_without_o_direct_when_the_first_write_refuses_it(tmp_path,
                                                                                monkeypatch):
    """Some filesystems accept O_DIRECT at open and refuse it (EINVAL) at the first write:
    the writer drops the flag and writes the same bytes the ordinary way."""
    import errno

    from workers import checkpoint_write as cw

    real_write, calls = os.write, []

    def refuse_once(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(cw.os, "write", refuse_once)
    data = os.urandom(cw.BUFFER_BYTES + 10)
    with cw.HashedWriter(tmp_path / "f") as f:
        f.write(data)
    assert not f.direct and len(calls) == 3
    assert (tmp_path / "f").read_bytes() == data and f.digest == ck.file_digest(tmp_path / "f")


def test_a_direct_read_goes_on_without_o_direct_when_the_first_read_refuses_it(tmp_path,
                                                                                monkeypatch):
    """The reader's twin of the test above: a filesystem that accepts O_DIRECT at open and
    refuses it at the first read gets the flag dropped, and the file hashes as before."""
    import errno
    import fcntl

    from workers import checkpoint_write as cw

    data = os.urandom(cw.BUFFER_BYTES + 10)
    (tmp_path / "f").write_bytes(data)
    want = ck.file_digest(tmp_path / "f")
    real_readv, calls = os.readv, []

    def refuse_once(fd, buffers):
        calls.append(bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT))
        if len(calls) == 1:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_readv(fd, buffers)

    monkeypatch.setattr(cw.os, "readv", refuse_once)
    assert ck.file_digest(tmp_path / "f", direct=True) == want
    assert calls == [True, False, False, False]     # refused, then two reads and the end


def test_torch_save_hashed_writes_what_torch_load_reads(tmp_path):
    """The optimizer file goes through the writer: it is an ordinary torch file."""
    import torch

    from workers.checkpoint_write import torch_save_hashed

    state = {"state": {i: {"exp_avg": torch.randn(1000 + i)} for i in range(3)}, "lr": 0.1}
    digest = torch_save_hashed(state, tmp_path / "optimizer.pt")
    back = torch.load(tmp_path / "optimizer.pt", weights_only=False)
    assert back["lr"] == 0.1 and all(torch.equal(back["state"][i]["exp_avg"], v["exp_avg"])
                                     for i, v in state["state"].items())
    assert digest == ck.file_digest(tmp_path / "optimizer.pt")


def test_torch_save_hashed_skips_the_zip_crc32_and_leaves_torch_as_it_was(tmp_path):
    """Its zip records carry no CRC-32 (the digest covers the bytes); torch's own switch is
    back as it was afterwards, also after a save that fails, so the process's other
    `torch.save` calls still write CRCs."""
    import zipfile

    import torch

    from workers.checkpoint_write import torch_save_hashed

    state = {"m": torch.randn(10_000)}
    torch_save_hashed(state, tmp_path / "ours.pt")
    torch.save(state, tmp_path / "plain.pt")
    crcs = lambda p: {i.filename.rsplit("/", 1)[-1]: i.CRC for i in zipfile.ZipFile(p).infolist()
                      if i.file_size}
    assert set(crcs(tmp_path / "ours.pt").values()) == {0}
    assert 0 not in crcs(tmp_path / "plain.pt").values()
    assert torch.equal(torch.load(tmp_path / "ours.pt")["m"], state["m"])
    from torch.utils.serialization import config
    assert config.save.storage_alignment == 64
    assert torch.serialization.get_crc32_options() is True
    with pytest.raises(Exception):
        torch_save_hashed({"f": lambda: 0}, tmp_path / "bad.pt")    # a lambda does not pickle
    assert torch.serialization.get_crc32_options() is True


def test_save_pretrained_through_the_hashed_writer_writes_what_safetensors_reads(tmp_path):
    """`safetensors_hashed`: the weights `save_pretrained` writes inside it are a safetensors
    file with the same tensors and metadata as its own writer's, `from_pretrained` loads it,
    the digest is the file's, and transformers' writer is back afterwards, also when
    the save fails. Every dtype of the table round-trips, and an empty tensor too."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, modeling_utils

    from workers.checkpoint_write import safetensors_hashed, safetensors_save_hashed
    from comlrl.tiny_model import build_tiny_model

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m"))
    original = modeling_utils.safe_save_file
    model.save_pretrained(tmp_path / "plain")
    digests: dict[str, str] = {}
    with safetensors_hashed(digests):
        assert modeling_utils.safe_save_file is not original
        model.save_pretrained(tmp_path / "hashed")
    assert modeling_utils.safe_save_file is original
    ours, theirs = tmp_path / "hashed" / "model.safetensors", tmp_path / "plain" / "model.safetensors"
    assert digests == {"model.safetensors": ck.file_digest(ours)}
    with safe_open(str(ours), "pt") as a, safe_open(str(theirs), "pt") as b:
        assert a.metadata() == b.metadata() == {"format": "pt"}
        assert sorted(a.keys()) == sorted(b.keys())
        for name in a.keys():
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hashed")
    for name, value in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name

    g = torch.Generator().manual_seed(0)
    mixed = {"f64": torch.randn(3, 2, dtype=torch.float64, generator=g),
             "bf16": torch.randn(5, generator=g).to(torch.bfloat16),
             "f16": torch.randn(7, generator=g).half(), "i64": torch.arange(-3, 4),
             "i32": torch.arange(9, dtype=torch.int32).reshape(3, 3).t(),   # not contiguous
             "i16": torch.tensor([1, -2], dtype=torch.int16),
             "i8": torch.tensor([-7], dtype=torch.int8), "u8": torch.tensor([255], dtype=torch.uint8),
             "bool": torch.tensor([True, False, True]), "empty": torch.zeros(0, 4)}
    digest = safetensors_save_hashed(mixed, tmp_path / "mixed.safetensors", {"k": "v"})
    assert digest == ck.file_digest(tmp_path / "mixed.safetensors")
    loaded = load_file(str(tmp_path / "mixed.safetensors"))
    assert loaded.keys() == mixed.keys()
    for name, value in mixed.items():
        assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value), name

    with pytest.raises(FileNotFoundError):
        with safetensors_hashed({}):
            modeling_utils.safe_save_file({"w": torch.zeros(2)}, str(tmp_path / "no" / "f"))
    assert modeling_utils.safe_save_file is original


# ------------------------------------------------------------------ C. full disk


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (needs root and mount rights)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        import gc

        gc.collect()  # a failed torch.save may still hold its file open
        if subprocess.run(["umount", str(mnt)]).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=True)


def _fill(path: Path) -> None:
    """Write until the disk is full."""
    with open(path, "wb", buffering=0) as f:
        for chunk in (1 << 16, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError:
                pass


def test_learner_save_on_a_full_disk_gives_a_clear_error_and_keeps_earlier(small_disk):
    d = small_disk / "ckpt"
    cp = Checkpointer(str(d), None, RUN_A)
    _write(cp, 1, n_floats=100_000)  # about 0.5 MB
    size1 = ck.checkpoint_size(d / "checkpoint-1")
    staging = Path(cp.begin(2))
    with pytest.raises(Exception) as failure:  # what safetensors/torch raise inside save
        _save_agent(staging / "agent_0", 400_000)
    assert is_disk_full(failure.value)
    with pytest.raises(CheckpointWriteError) as err:
        cp.abort(2, f"{type(failure.value).__name__}: {failure.value}")
    msg = str(err.value)
    assert f"checkpoint_dir {d}" in msg and "ran out of disk space" in msg
    assert f"about {size1} bytes" in msg and "checkpoint-1" in msg
    assert not staging.exists()
    assert sorted(p.name for p in d.iterdir()) == ["checkpoint-1"]
    verify_checksums(d / "checkpoint-1")


def test_torch_save_on_a_full_disk_is_recognised(small_disk):
    import torch

    _fill(small_disk / "filler")
    with pytest.raises(Exception) as failure:
        torch.save({"w": torch.zeros(100_000)}, small_disk / "optimizer.pt")
    assert is_disk_full(f"{type(failure.value).__name__}: {failure.value}") or \
        is_disk_full(failure.value)


def test_commit_on_a_full_disk_removes_staging_and_keeps_earlier(small_disk):
    d = small_disk / "ckpt"
    cp = Checkpointer(str(d), None, RUN_A)
    _write(cp, 1, n_floats=100_000)
    staging = Path(cp.begin(2))
    _save_agent(staging / "agent_0", 100_000, seed=2)
    _fill(small_disk / "filler")  # metadata.json no longer fits
    with pytest.raises(CheckpointWriteError) as err:
        cp.commit(2, {"epoch": 2, "run_uid": RUN_A})
    msg = str(err.value)
    assert f"checkpoint_dir {d}" in msg and "bytes" in msg and "ran out of disk space" in msg
    assert not staging.exists() and not (d / "checkpoint-2").exists()
    verify_checksums(d / "checkpoint-1")


def test_begin_on_a_full_disk_leaves_no_unmarked_folder(small_disk):
    d = small_disk / "ckpt"
    cp = Checkpointer(str(d), None, RUN_A)
    _write(cp, 1, n_floats=100_000)
    _fill(small_disk / "filler")
    with pytest.raises(CheckpointWriteError, match="ran out of disk space") as err:
        cp.begin(2)
    assert str(d) in str(err.value)
    assert sorted(p.name for p in d.iterdir()) == ["checkpoint-1"]
    (small_disk / "filler").unlink()
    check_checkpoint_dir(d, read_checkpoint_metadata(d / "checkpoint-1"))


def test_check_free_space_warns_below_the_newest_checkpoint_size(small_disk):
    d = small_disk / "ckpt"
    assert check_free_space(d) is None
    cp = Checkpointer(str(d), None, RUN_A)
    _write(cp, 1, n_floats=100_000)
    assert check_free_space(d) is None  # ~1.4 MB free, checkpoint ~0.5 MB
    _fill(small_disk / "filler")
    text = check_free_space(d)
    assert text is not None and str(d) in text and "checkpoint-1" in text
    assert str(ck.checkpoint_size(d / "checkpoint-1")) in text
    assert cp.free_space_warning() == text


def test_abort_for_another_failure_says_what_failed(tmp_path):
    d = tmp_path / "ckpt"
    cp = Checkpointer(str(d), None, RUN_A)
    _write(cp, 1)
    staging = Path(cp.begin(2))
    (staging / "agent_0").mkdir()
    with pytest.raises(CheckpointWriteError) as err:
        cp.abort(2, "ValueError: learner 1 has no model")
    msg = str(err.value)
    assert "learner 1 has no model" in msg and str(d) in msg and "disk space" not in msg
    assert not staging.exists() and (d / "checkpoint-1").is_dir()


# ------------------------------------------------------------------ B. fingerprints

TARGET = 2
SCALE = (1.5, "x")


def reward(completions1, completions2, target=1):
    return [float(len(a) - len(b) == target) for a, b in zip(completions1, completions2)]


def reward_reading_globals(completions1, completions2):
    return [TARGET * SCALE[0] for _ in completions1]


def make_closure(k):
    def scaled(completions1, completions2):
        return [k * len(a) for a in completions1]
    return scaled


class RewardModel:
    def __init__(self, weight, table=None):
        self.weight = weight
        self.table = table or {"a": [1, 2], "b": (3.0, None)}

    def __call__(self, completions1, completions2):
        return [self.weight for _ in completions1]

    def score(self, completions1, completions2):
        return self(completions1, completions2)


class TensorReward:
    def __init__(self, scale):
        import torch

        self.w = torch.full((4,), float(scale))

    def state_dict(self):
        return {"w": self.w}

    def __call__(self, completions1, completions2):
        return [float(self.w.sum())] * len(completions1)


class LockedReward:
    def __init__(self):
        self.lock = threading.Lock()

    def __call__(self, completions1, completions2):
        return [0.0] * len(completions1)


def cross_process_callables():
    """Built the same way in this process and in a fresh one."""
    return {"partial": functools.partial(reward, target=2),
            "closure": make_closure(3),
            "object": RewardModel(0.5),
            "method": RewardModel(0.25).score,
            "tensor_object": TensorReward(2),
            "plain": reward,
            "globals": reward_reading_globals}


def test_partial_fingerprint_covers_args_and_keywords():
    a = fingerprint_callable(functools.partial(reward, target=2))
    assert a == fingerprint_callable(functools.partial(reward, target=2))
    assert a != fingerprint_callable(functools.partial(reward, target=3))
    assert a != fingerprint_callable(functools.partial(reward, ["x"], target=2))
    assert a.startswith("partial:tests.test_checkpoint_safety.reward:")


def test_closure_fingerprint_covers_cell_values():
    assert fingerprint_callable(make_closure(3)) == fingerprint_callable(make_closure(3))
    assert fingerprint_callable(make_closure(3)) != fingerprint_callable(make_closure(4))
    assert fingerprint_callable(make_closure("a")) != fingerprint_callable(make_closure("b"))


def test_callable_object_and_bound_method_fingerprints_cover_their_state():
    assert fingerprint_callable(RewardModel(0.5)) == fingerprint_callable(RewardModel(0.5))
    assert fingerprint_callable(RewardModel(0.5)) != fingerprint_callable(RewardModel(0.6))
    assert fingerprint_callable(RewardModel(0.5, {"a": [1]})) != \
        fingerprint_callable(RewardModel(0.5, {"a": [2]}))
    assert fingerprint_callable(RewardModel(1).score) != fingerprint_callable(RewardModel(2).score)
    assert fingerprint_callable(TensorReward(2)) == fingerprint_callable(TensorReward(2))
    assert fingerprint_callable(TensorReward(2)) != fingerprint_callable(TensorReward(3))
    fp = fingerprint_callable(RewardModel(0.5))
    assert "0x" not in fp and fp.startswith("tests.test_checkpoint_safety.RewardModel:")


def test_plain_function_fingerprint_is_unchanged(monkeypatch):
    # The formula of earlier versions: name plus the hash of the source.
    src = inspect.getsource(make_closure)
    want = f"tests.test_checkpoint_safety.make_closure:{hashlib.sha256(src.encode()).hexdigest()[:16]}"
    assert fingerprint_callable(make_closure) == want
    assert fingerprint_callable(None) is None
    # Simple global constants it reads are covered.
    before = fingerprint_callable(reward_reading_globals)
    monkeypatch.setattr(sys.modules[__name__], "TARGET", 5)
    assert fingerprint_callable(reward_reading_globals) != before


def test_fingerprints_are_equal_in_a_fresh_process():
    here = {k: fingerprint_callable(v) for k, v in cross_process_callables().items()}
    code = ("import json\nfrom comlrl.fingerprints import fingerprint_callable\n"
            "from tests.test_checkpoint_safety import cross_process_callables\n"
            "print(json.dumps({k: fingerprint_callable(v) "
            "for k, v in cross_process_callables().items()}))")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == here
    assert len(set(here.values())) == len(here)


def test_unfingerprintable_state_warns_once_naming_callable_and_setting():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = fingerprint_callable(LockedReward(), "reward_func")
        b = fingerprint_callable(LockedReward(), "reward_func", warn=False)
    assert a == b and "0x" not in a
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "reward_func" in text and "LockedReward" in text and "lock" in text
    assert "MAGRPOConfig(skip_callable_fingerprints=True)" in text
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fingerprint_callable(functools.partial(reward, target=2), "reward_func")
    assert caught == []


def test_compare_fingerprints_can_skip_the_callables():
    saved = {"config": {"lr": 1}, "reward_func": "a", "formatters": ["x"], "dataset": "d"}
    current = {"config": {"lr": 1}, "reward_func": "b", "formatters": ["y"], "dataset": "d"}
    with pytest.raises(CheckpointError, match="skip_callable_fingerprints=True"):
        compare_fingerprints(saved, current, frozenset())
    compare_fingerprints(saved, current, frozenset(), skip_callables=True)
    with pytest.raises(CheckpointError, match="dataset"):
        compare_fingerprints(saved, {**current, "dataset": "e"}, frozenset(), skip_callables=True)


def test_closures_over_arrays_tensors_and_tokenizer_like_objects():
    import numpy as np
    import torch

    fp = fingerprint_callable
    assert fp(make_closure(np.array([1, 2]))) == fp(make_closure(np.array([1, 2])))
    assert fp(make_closure(np.array([1, 2]))) != fp(make_closure(np.array([1, 3])))
    assert fp(make_closure(torch.ones(3))) != fp(make_closure(torch.ones(3, dtype=torch.float16)))
    # Large tensors are hashed on a sample (dtype, shape and 2^20 evenly spaced elements).
    big = torch.zeros(17_000_000)
    same = fp(make_closure(big))
    assert fp(make_closure(big.clone())) == same
    big[0] = 1.0
    assert fp(make_closure(big)) != same

    class Vocab:
        eos_token, pad_token, chat_template = "</s>", "<pad>", None

        def __init__(self, words):
            self.words, self.backend = words, threading.Lock()  # a handle, as in Rust tokenizers

        def get_vocab(self):
            return {w: i for i, w in enumerate(self.words)}

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fp(make_closure(Vocab(["a", "b"]))) != fp(make_closure(Vocab(["a", "c"])))


def test_checkpoint_lacking_a_learners_files_is_not_published(tmp_path):
    """On a cluster without shared storage the learners write their agent folders on their
    own node: a checkpoint whose staging folder lacks files a learner reported writing is
    refused with the fix, and never gets its public name."""
    from comlrl.checkpoint import begin_staging, commit_checkpoint

    staging = begin_staging(tmp_path, 1, RUN_A)
    (staging / "agent_0").mkdir()
    (staging / "agent_0" / "model.safetensors").write_bytes(b"w")
    meta = {"run_uid": RUN_A, "env_step": 4,
            "agent_files": {"agent_0": ["model.safetensors"], "agent_1": ["model.safetensors"]}}
    with pytest.raises(CheckpointWriteError, match="agent_1/model.safetensors.*every node shares"):
        commit_checkpoint(staging, meta)
    assert not (tmp_path / "checkpoint-1").exists()


def test_a_weight_left_unloaded_is_refused_unless_tied():
    """Loading a state dict must load every weight: a missing key passes only when its tensor
    is tied to a loaded one (lm_head sharing the embedding, stored once by save_pretrained)."""
    import torch

    from workers.engines import check_loaded

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(4, 3)
            self.head = torch.nn.Linear(3, 4, bias=False)
            self.head.weight = self.embed.weight
            self.norm = torch.nn.LayerNorm(3)

    model = Tied()
    state = {k: v for k, v in model.state_dict().items() if k != "head.weight"}
    result = model.load_state_dict(state, strict=False)
    assert result.missing_keys == ["head.weight"]
    check_loaded(model, result.missing_keys, result.unexpected_keys, "tied")
    state.pop("norm.weight")
    result = model.load_state_dict(state, strict=False)
    with pytest.raises(ValueError, match=r"not loaded \['norm.weight'\]"):
        check_loaded(model, result.missing_keys, result.unexpected_keys, "untied")


def test_the_session_counters_go_into_checkpoint_metadata_and_come_back_unchanged():
    """Issue 36: save, manual save, resume and heal all go through `Progress`: what it writes
    under the metadata's names is what it reads back, and {} is a fresh start."""
    from workers.driver.session import Progress

    counters = Progress(epoch=3, learner_updates=7, last_train_log=24)
    meta = counters.to_metadata(env_step=32)
    assert meta == {"env_step": 32, "epoch": 3, "update_index": 7, "last_train_log": 24}
    assert Progress.from_metadata(meta) == (counters, 32)
    assert Progress.from_metadata({}) == (Progress(0, 0, -1), 0)
