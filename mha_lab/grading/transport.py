"""Submissions as bytes, so that a grading worker needs no view of the course folder.

The client packs a submission folder into a tar archive (regular files, folders and symbolic links as
links, never followed; ``cap`` bytes of files at most) with its SHA-256. A Dask worker, on this machine or
another, checks the digest and unpacks it into a private temporary folder, refusing any member that would
land outside it, then grades that folder. The release and the hidden checks travel once per worker as
values (``Assignment``), never as paths.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

__all__ = ["Packed", "Assignment", "pack", "unpacked", "hidden_checks"]

MAX_MEMBERS = 10_000


@dataclass(frozen=True)
class Packed:
    """One submission folder as bytes: a tar archive and its SHA-256 (hex); ``error`` when it cannot travel."""

    data: bytes
    sha256: str
    error: str = ""


@dataclass(frozen=True)
class Assignment:
    """What every worker needs once per assignment: its name, the release's notebooks (name -> notebook
    as a dict), the source of its hidden checks and the files the release ships beside its notebooks."""

    name: str
    releases: dict[str, dict]
    hidden_source: str
    release_files: dict[str, bytes]


def pack(folder: Path, cap: int) -> Packed:
    """The submission ``folder`` as a tar archive: files, folders and links (as links) under it, the files'
    sizes summed to at most ``cap`` bytes (a larger one is left out, as the sandbox's copy leaves it out)."""
    folder = Path(folder)
    if folder.is_symlink() or not folder.is_dir():
        return Packed(b"", "", f"{folder.name} is {'a symbolic link' if folder.is_symlink() else 'missing'}, "
                               "not a submitted folder")
    buffer, total = io.BytesIO(), 0
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for count, path in enumerate(sorted(folder.rglob("*"))):
            if count >= MAX_MEMBERS:
                return Packed(b"", "", f"more than {MAX_MEMBERS} files in the submission folder")
            if not (path.is_symlink() or path.is_dir() or path.is_file()):
                continue  # sockets, fifos, devices: nothing a notebook needs
            if path.is_file() and not path.is_symlink():
                if total + path.stat().st_size > cap:
                    continue
                total += path.stat().st_size
            tar.add(path, arcname=path.relative_to(folder).as_posix(), recursive=False)
    data = buffer.getvalue()
    return Packed(data, hashlib.sha256(data).hexdigest())


def _safe(name: str) -> PurePosixPath:
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise ValueError(f"refused archive member {name!r}: it would land outside the submission folder")
    return path


@contextmanager
def unpacked(packed: Packed, name: str = "submission") -> Iterator[Path]:
    """A private temporary folder holding the unpacked submission at ``<tmp>/<name>``, removed afterwards;
    ValueError when the digest does not match or a member is not a file, folder or link inside it."""
    if hashlib.sha256(packed.data).hexdigest() != packed.sha256:
        raise ValueError("the submission's bytes do not match their SHA-256: it was damaged on the way")
    with tempfile.TemporaryDirectory(prefix="mha_lab_unpacked_") as tmp:
        root = Path(tmp) / name
        root.mkdir(mode=0o700)
        with tarfile.open(fileobj=io.BytesIO(packed.data), mode="r:") as tar:
            for member in tar.getmembers()[:MAX_MEMBERS]:
                target = root / _safe(member.name)
                if any(p.is_symlink() for p in [target.parent, *target.parent.parents] if root in p.parents):
                    raise ValueError(f"refused archive member {member.name!r}: it is inside a link")
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                elif member.issym():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.symlink(member.linkname, target)  # kept as a link, never followed here
                elif member.isfile():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with tar.extractfile(member) as src, open(target, "xb") as dst:
                        dst.write(src.read())
                else:
                    raise ValueError(f"refused archive member {member.name!r}: not a file, folder or link")
        yield root


@contextmanager
def hidden_checks(assignment: Assignment) -> Iterator[Path]:
    """The assignment's hidden checks as a file of a private temporary folder (the judge loads a path)."""
    with tempfile.TemporaryDirectory(prefix="mha_lab_hidden_") as tmp:
        path = Path(tmp) / f"test_{assignment.name}.py"
        path.write_text(assignment.hidden_source)
        yield path
