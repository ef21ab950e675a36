"""A model as it travels to an actor: a folder path, or the folder's files packed into the
object store for actors on other nodes, written out again where they load it."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path


def pack_model_folder(path: str) -> dict:
    """A saved model folder as {file name: bytes}, to ship through the object store; an actor
    loads it through `model_folder`."""
    folder = Path(path)
    return {"name": folder.name,
            "files": {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.is_file()}}


@contextlib.contextmanager
def model_folder(source: str | dict):
    """A folder to load `source` from while the block runs: a path (or hub name) as is, or a
    packed folder written out and removed when the block ends, loaded or not, so an actor
    whose engine or learner fails to start leaves no copy of the model behind."""
    if isinstance(source, str):
        yield source
        return

    folder = Path(tempfile.mkdtemp(prefix=f"comlrl-{source['name']}-"))
    try:
        for name, data in source["files"].items():
            (folder / name).write_bytes(data)
        yield str(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
