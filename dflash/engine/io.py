"""Atomic writes: a file or a folder appears whole or not at all, so a killed process never
leaves a half-written checkpoint, shard or converted model that looks complete. The one
helper for every writer in the project (checkpoints, exports, shards, the target cache)."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling path (same suffix, so writers that add one do not); when the
    block ends without error it replaces `path`, else it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text)


@contextmanager
def atomic_folder(dest: str | Path, replace: bool = True) -> Iterator[Path]:
    """Yield an empty temporary sibling folder to fill; when the block ends without error it
    becomes `dest`. An existing `dest` is replaced (`replace=True`) or, with `replace=False`,
    kept: whoever finished first wins, and our copy is dropped. On error nothing changes."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))
    try:
        yield tmp
        if not dest.exists():
            try:
                os.replace(tmp, dest)
                return
            except OSError:  # another process put a non-empty folder there first
                if not replace:
                    return
        if replace:
            old = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.old-"))
            os.replace(dest, old / "x")
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
