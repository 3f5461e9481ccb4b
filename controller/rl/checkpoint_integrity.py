"""Checksums of a checkpoint's files, written into its commit record and verified before it is loaded.

::

    files = checksums(root, [root / "actor" / "step_00000004", root / "trainer" / "step_00000004.schedule.pt"])
    state["files"] = files                      # {path relative to root: {"bytes": n, "sha256": hex}}
    problems = verify(root, files)              # [] when every file is there, whole and unchanged

A file that is missing, shorter or longer (torn: a copy or a write cut short), or whose bytes changed (a flipped
bit) is a problem naming the file and what differs. The files are hashed on threads (hashlib releases the
GIL on large buffers), a read of every byte: about a second per GB and core.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

__all__ = ["checksums", "verify"]

_CHUNK = 8 << 20


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(parts: Iterable[Path]) -> list[Path]:
    out = []
    for part in parts:
        if part.is_dir():
            out += sorted(p for p in part.rglob("*") if p.is_file())
        elif part.is_file():
            out.append(part)
    return out


def _workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def checksums(root: Path, parts: Iterable[Path]) -> dict[str, dict[str, int | str]]:
    """``{path relative to root: {"bytes": size, "sha256": hex}}`` of every file in ``parts`` (files, or
    directories walked whole)."""
    files = _files(parts)
    with ThreadPoolExecutor(_workers()) as pool:
        digests = list(pool.map(_sha256, files))
    return {path.relative_to(root).as_posix(): {"bytes": path.stat().st_size, "sha256": digest}
            for path, digest in zip(files, digests)}


def verify(root: Path, files: dict[str, dict[str, int | str]]) -> list[str]:
    """What is wrong with the files ``checksums`` recorded under ``root``, a line per file in name order (empty:
    all whole and unchanged)."""
    problems: list[str] = []
    present = []
    for name, record in sorted(files.items()):
        path = root / name
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        size = path.stat().st_size
        if size != record["bytes"]:
            problems.append(f"{name}: {size} bytes, {record['bytes']} written (torn)")
            continue
        present.append((name, path, record))
    with ThreadPoolExecutor(_workers()) as pool:
        digests = list(pool.map(_sha256, [path for _, path, _ in present]))
    for (name, _, record), digest in zip(present, digests):
        if digest != record["sha256"]:
            problems.append(f"{name}: sha256 {digest[:12]}..., {str(record['sha256'])[:12]}... written (changed)")
    return sorted(problems)  # by file
