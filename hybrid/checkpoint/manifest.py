"""Integrity: every checkpoint lists its files (size and a checksum of each) in a manifest written once
every rank's files are complete, so a torn or changed checkpoint is found before anything is unpickled."""

from __future__ import annotations

import json
import os
import re
import zlib
from typing import Optional

from hybrid.checkpoint.files import write_atomic

MANIFEST = "hybrid_manifest.json"  # in each tag's directory, written once every rank's files are complete
_SAMPLE_BYTES = 1 << 16  # the checksum covers each file's first and last 64 KiB: cheap, and catches truncation


def file_digest(path: str) -> dict:
    """Size and a CRC-32 of the head and tail of one file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        crc = zlib.crc32(f.read(_SAMPLE_BYTES))
        if size > _SAMPLE_BYTES:
            f.seek(max(_SAMPLE_BYTES, size - _SAMPLE_BYTES))
            crc = zlib.crc32(f.read(), crc)
    return {"size": size, "crc32": crc}


def _checkpoint_files(ckpt: str) -> list[str]:
    files = []
    for folder, _, names in os.walk(ckpt):
        files += [os.path.relpath(os.path.join(folder, n), ckpt) for n in names if n != MANIFEST]
    return sorted(files)


def write_manifest(ckpt: str) -> None:
    """Record every file of the checkpoint directory `ckpt` with its size and checksum (atomically)."""
    manifest = {name: file_digest(os.path.join(ckpt, name)) for name in _checkpoint_files(ckpt)}
    write_atomic(os.path.join(ckpt, MANIFEST), json.dumps({"files": manifest}, indent=0, sort_keys=True))


def verify_manifest(ckpt: str) -> Optional[str]:
    """None if every file the manifest lists is there with its size and checksum (or the checkpoint has
    no manifest: written before hybrid recorded one), else what is wrong, naming the file."""
    path = os.path.join(ckpt, MANIFEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        files = json.load(f)["files"]
    for name, want in files.items():
        file = os.path.join(ckpt, name)
        if not os.path.isfile(file):
            return f"{file} is missing"
        got = file_digest(file)
        if got["size"] != want["size"]:
            return f"{file} has {got['size']} bytes, {want['size']} were written (truncated or replaced)"
        if got["crc32"] != want["crc32"]:
            return f"{file} does not match the checksum written with it (corrupt or replaced)"
    return None


def has_manifest(ckpt: str) -> bool:
    return os.path.isfile(os.path.join(ckpt, MANIFEST))


def complete_tags(load_dir: str) -> list[str]:
    """The iteration tags in `load_dir` whose manifest verifies, newest first."""
    tags = [n for n in os.listdir(load_dir)
            if re.fullmatch(r"iter_\d{7}", n) and has_manifest(os.path.join(load_dir, n))]
    return [t for t in sorted(tags, reverse=True) if verify_manifest(os.path.join(load_dir, t)) is None]


def tag_to_resume(load_dir: str, tag: str) -> tuple[str, Optional[str]]:
    """(the tag a resume of `tag` loads, why not `tag`): `tag` if its files are as its manifest lists them, else the
    newest older complete checkpoint ("" where there is none) and the problem of `tag`."""
    problem = verify_manifest(os.path.join(load_dir, tag))
    if problem is None:
        return tag, None
    older = [t for t in complete_tags(load_dir) if t < tag]
    return (older[0] if older else ""), problem
