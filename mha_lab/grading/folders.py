"""Walks and copies of a student's folder that cannot blow up.

Every walk of a submission goes through ``walk``: iterative (a folder thousands of levels deep costs no
recursion), never following links, never opening anything but regular files, and bounded while it walks: at most
``Caps.depth`` levels, ``Caps.entries`` entries (each folder is read only up to what is left of that),
``Caps.bytes`` bytes of files in all and paths of ``Caps.path`` bytes. What lies past a cap is left out and said
so, each reason once: the rest of the folder is graded as usual.
"""

from __future__ import annotations

import atexit
import collections
import errno
import io
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from mha_lab.grading.text import writable_name

__all__ = ["Caps", "Entry", "Walk", "walk", "data_regions", "RegionReader", "copy_stream", "open_file", "copy",
           "temporary_parent"]

CHUNK = 1 << 20  # bytes read at a time when copying a file
REASONS = 8  # reasons kept for the feedback; past that, a count
NAME = 120  # characters of a path shown in a reason
REGIONS = 1024  # data regions of a file with holes kept apart; past that, the file is read whole
TEMPORARY = "mha_lab_grader_"  # <tmp>/mha_lab_grader_<uid>_<pid>: one grading process's temporary folders
_parent: dict[int, str] = {}  # pid -> its folder, made once per process


def temporary_parent() -> str:
    """This process's folder for the grader's temporary folders (submissions unpacked and copied, hidden checks),
    ``<tmp>/mha_lab_grader_<uid>_<pid>``, private to its user. Made on first use, after removing those of this
    user's processes that are gone: a grading process killed mid-submission (the OOM killer, a lost Dask worker)
    cannot remove its own, and they hold students' work."""
    pid = os.getpid()
    if pid not in _parent:
        root, mine = Path(tempfile.gettempdir()), f"{TEMPORARY}{os.getuid()}_"
        for old in root.glob(f"{mine}*"):
            other = old.name.removeprefix(mine)
            if other.isdigit() and not _alive(int(other)) and old.lstat().st_uid == os.getuid():
                shutil.rmtree(old, ignore_errors=True)
        folder = root / f"{mine}{pid}"
        folder.mkdir(mode=0o700, exist_ok=True)
        if folder.is_symlink() or folder.lstat().st_uid != os.getuid():
            raise PermissionError(f"{folder} is not this user's own folder: refusing to put students' work there")
        _parent[pid] = str(folder)
        atexit.register(lambda: os.getpid() == pid and shutil.rmtree(folder, ignore_errors=True))  # not in a fork
    return _parent[pid]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process has that id now
        pass
    return True


@dataclass(frozen=True)
class Caps:
    """How much of a submission folder the grader looks at."""

    depth: int = 32  # levels of folders below the submission folder
    entries: int = 10_000  # files, folders and links
    bytes: int = 256 * 2**20  # of the files, summed
    path: int = 1024  # bytes of a path below the submission folder: copies of it must stay under PATH_MAX


@dataclass(frozen=True)
class Entry:
    """One thing in the folder: its path, its path relative to the folder (POSIX), its kind and size in bytes."""

    path: Path
    relative: str
    kind: str  # "file", "folder" or "link"
    size: int = 0


@dataclass
class Walk:
    """What ``walk`` found, in name order (parents before children), and what it left out, with why."""

    entries: list[Entry] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    more: int = 0  # reasons past the first REASONS

    def leave_out(self, relative: str, why: str) -> None:
        if len(self.left_out) < REASONS:
            name = writable_name(relative)
            name = name if len(name) <= NAME else f"{name[:NAME // 2]}...{name[-NAME // 2:]}"
            self.left_out.append(f"{name} ({why})")
        else:
            self.more += 1

    def note(self) -> str:
        """One sentence for the student ('' when nothing was left out)."""
        if not self.left_out:
            return ""
        more = f" and {self.more} more" if self.more else ""
        return f"left out of the submission: {'; '.join(self.left_out)}{more}"


def walk(folder: Path, caps: Caps = Caps()) -> Walk:
    """Everything under ``folder`` (not itself), within ``caps``; links are listed as links, never followed;
    pipes, sockets and devices are left out (nothing a notebook needs)."""
    found, budget, count, full = Walk(), caps.bytes, 0, False
    stack: list[tuple[Path, str, int]] = [(Path(folder), "", 0)]  # (folder, relative path, depth) to read
    while stack and not full:
        where, relative, depth = stack.pop()
        children = []
        try:
            with os.scandir(where) as it:
                for item in it:
                    if count + len(children) >= caps.entries:
                        found.leave_out(relative or "the submission folder",
                                        f"more than {caps.entries} entries in the submission")
                        full = True  # nothing more is read
                        break
                    children.append(item)
        except OSError as exc:
            found.leave_out(relative or "the submission folder", f"cannot be read: {exc.strerror}")
        folders = []
        for item in sorted(children, key=lambda e: e.name):
            rel = f"{relative}/{item.name}" if relative else item.name
            if len(os.fsencode(rel)) > caps.path:
                found.leave_out(rel, f"a path longer than {caps.path} bytes")
                continue
            try:
                mode = item.stat(follow_symlinks=False).st_mode
                size = item.stat(follow_symlinks=False).st_size
            except OSError as exc:
                found.leave_out(rel, f"cannot be read: {exc.strerror}")
                continue
            if stat.S_ISLNK(mode):
                found.entries.append(Entry(Path(item.path), rel, "link"))
            elif stat.S_ISDIR(mode):
                if depth + 1 > caps.depth:
                    found.leave_out(rel, f"a folder deeper than {caps.depth} levels")
                    continue
                found.entries.append(Entry(Path(item.path), rel, "folder"))
                folders.append((Path(item.path), rel, depth + 1))
            elif stat.S_ISREG(mode):
                if size > budget:
                    found.leave_out(rel, f"{size} bytes: past the {caps.bytes} bytes of files a submission may hold")
                    continue
                budget -= size
                found.entries.append(Entry(Path(item.path), rel, "file", size))
            else:
                found.leave_out(rel, "not a file, folder or link")
                continue
            count += 1
        stack.extend(reversed(folders))  # the first folder is read next: name order, depth first
    return found


def data_regions(fd: int, size: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of the data in the first ``size`` bytes of the open file ``fd``, its holes left out
    (``SEEK_DATA``, ``SEEK_HOLE``); the whole file where the file system cannot say, or the regions are many."""
    regions, position = [], 0
    try:
        while position < size and len(regions) <= REGIONS:
            try:
                start = os.lseek(fd, position, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # nothing but a hole is left
                    break
                raise
            if start >= size:
                break
            position = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            regions.append((start, position - start))
    except OSError:
        regions = [(0, size)]
    finally:
        os.lseek(fd, 0, os.SEEK_SET)
    return regions if len(regions) <= REGIONS else [(0, size)]


class RegionReader(io.RawIOBase):
    """A file read as its ``regions`` one after the other (what ``tarfile`` packs of a file with holes)."""

    def __init__(self, file: BinaryIO, regions: list[tuple[int, int]]) -> None:
        super().__init__()
        self.file, self.regions, self.left = file, collections.deque(regions), 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (all that is left when ``n`` < 0), across regions: short only at the end."""
        parts, want = [], n if n is not None and n >= 0 else None
        while want is None or want > 0:
            while not self.left and self.regions:
                offset, self.left = self.regions.popleft()
                self.file.seek(offset)
            chunk = self.file.read(self.left if want is None else min(want, self.left)) if self.left else b""
            if not chunk:
                break
            parts.append(chunk)
            self.left -= len(chunk)
            want = None if want is None else want - len(chunk)
        return b"".join(parts)


def copy_stream(source: BinaryIO, target: BinaryIO, size: int) -> None:
    """Copy ``size`` bytes of ``source`` to ``target``, a chunk at a time, seeking over chunks of zeros (the
    caller truncates ``target`` to its length at the end)."""
    left = size
    while left > 0 and (chunk := source.read(min(CHUNK, left))):
        if chunk.count(0) == len(chunk):
            target.seek(len(chunk), os.SEEK_CUR)
        else:
            target.write(chunk)
        left -= len(chunk)


def open_file(entry: Entry) -> BinaryIO:
    """``entry``'s file opened again to read, never through a link; OSError when it is no longer a regular file."""
    fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a pipe put in its place does not block
    file = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        file.close()
        raise OSError(f"{writable_name(entry.relative)} changed while it was read")
    return file


def copy(found: Walk, target: Path) -> None:
    """Make ``found``'s entries under the existing folder ``target``: folders (0o755), files (0o644, read again
    without following a link, at most the size the walk saw, holes kept) and links as links."""
    for entry in found.entries:
        path = target / entry.relative
        if entry.kind == "folder":
            path.mkdir(mode=0o755)
        elif entry.kind == "link":
            os.symlink(os.readlink(entry.path), path)
        else:
            with open_file(entry) as src, open(path, "xb") as dst:
                for offset, length in data_regions(src.fileno(), entry.size):
                    src.seek(offset)
                    dst.seek(offset)
                    copy_stream(src, dst, length)
                dst.truncate(entry.size)
            path.chmod(0o644)
