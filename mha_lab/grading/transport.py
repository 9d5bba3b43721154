"""Submissions as bytes, so that a grading worker needs no view of the course folder.

The client packs a submission folder into a tar archive (what ``folders.walk`` finds within its caps: files,
folders, and links as links, never followed) with its SHA-256. A file with holes (a sparse file) travels as
its data and where it goes (``DATA``, a PAX record): a 250 MiB file of nothing costs a few bytes to pack, send
and unpack. A Dask worker, on this machine or another, checks the digest and unpacks it into a private
temporary folder, a chunk at a time, refusing any member that would land outside it, then grades that folder.
The release and the hidden checks travel once per worker as values (``Assignment``), never as paths.
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

from mha_lab.grading import folders
from mha_lab.grading.text import writable_name

__all__ = ["Packed", "Assignment", "pack", "unpacked", "hidden_checks"]

DATA = "MHA_LAB.data"  # PAX record of a sparse file's member: "offset:length ..." of its data, then its size


@dataclass(frozen=True)
class Packed:
    """One submission folder as bytes: a tar archive and its SHA-256 (hex); ``error`` when it cannot travel,
    ``note`` what was left out of it (``folders.Walk.note``)."""

    data: bytes
    sha256: str
    error: str = ""
    note: str = ""


@dataclass(frozen=True)
class Assignment:
    """What every worker needs once per assignment: its name, the release's notebooks (name -> notebook
    as a dict), the source of its hidden checks and the files the release ships beside its notebooks."""

    name: str
    releases: dict[str, dict]
    hidden_source: str
    release_files: dict[str, bytes]


def pack(folder: Path, cap: int) -> Packed:
    """The submission ``folder`` as a tar archive of what ``folders.walk`` finds, the files' sizes summed to at
    most ``cap`` bytes (what lies past a cap is left out, and ``note`` says so)."""
    folder = Path(folder)
    if folder.is_symlink() or not folder.is_dir():
        return Packed(b"", "", f"{writable_name(folder.name)} is "
                               f"{'a symbolic link' if folder.is_symlink() else 'missing'}, not a submitted folder")
    found = folders.walk(folder, folders.Caps(bytes=cap))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in found.entries:
            info = tarfile.TarInfo(entry.relative)
            info.mode = 0o755 if entry.kind == "folder" else 0o644
            if entry.kind == "folder":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif entry.kind == "link":
                info.type, info.linkname = tarfile.SYMTYPE, os.readlink(entry.path)
                tar.addfile(info)
            else:
                _add_file(tar, info, entry)
    data = buffer.getvalue()
    return Packed(data, hashlib.sha256(data).hexdigest(), note=found.note())


def _add_file(tar: tarfile.TarFile, info: tarfile.TarInfo, entry: folders.Entry) -> None:
    """A regular file as it is now (never through a link, at most the size the walk saw): its data regions only,
    where it has holes."""
    with folders.open_file(entry) as f:
        regions = folders.data_regions(f.fileno(), entry.size)
        info.size = sum(length for _, length in regions)
        if info.size < entry.size:  # holes: the data travels alone, with where it goes
            info.pax_headers = {DATA: " ".join(f"{o}:{n}" for o, n in regions) + f" {entry.size}"}
        tar.addfile(info, folders.RegionReader(f, regions))


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
    with tempfile.TemporaryDirectory(prefix="mha_lab_unpacked_", dir=folders.temporary_parent()) as tmp:
        root = Path(tmp) / name
        root.mkdir(mode=0o700)
        with tarfile.open(fileobj=io.BytesIO(packed.data), mode="r:") as tar:
            for count, member in enumerate(tar):
                if count >= folders.Caps.entries:
                    raise ValueError(f"more than {folders.Caps.entries} members in the archive")
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
                        _write(src, dst, member)
                else:
                    raise ValueError(f"refused archive member {member.name!r}: not a file, folder or link")
        yield root


def _write(source: io.BufferedIOBase, target: io.BufferedIOBase, member: tarfile.TarInfo) -> None:
    """A file member into ``target``, its data where ``DATA`` says (holes left as holes)."""
    if DATA not in member.pax_headers:
        folders.copy_stream(source, target, member.size)
        target.truncate(member.size)
        return
    *regions, size = member.pax_headers[DATA].split()
    for region in regions:
        offset, length = (int(n) for n in region.split(":"))
        target.seek(offset)
        folders.copy_stream(source, target, length)
    target.truncate(int(size))


@contextmanager
def hidden_checks(assignment: Assignment) -> Iterator[Path]:
    """The assignment's hidden checks as a file of a private temporary folder (the judge loads a path)."""
    with tempfile.TemporaryDirectory(prefix="mha_lab_hidden_", dir=folders.temporary_parent()) as tmp:
        path = Path(tmp) / f"test_{assignment.name}.py"
        path.write_text(assignment.hidden_source)
        yield path
