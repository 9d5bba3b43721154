"""Hostile submissions against the grader: every attack of ``tests/adversarial/`` in a class of honest students.

One batch per assignment (most attacks are on ps1): two honest students, a blank one, a buggy one and the
attackers, graded with the real command on a Dask cluster shared with other tests (``--scheduler``). For each
attack: the batch finishes, every other student's grade is exact (CSV and gradebook), the attacker scores no
more than the blank release (or than its honest part earns), its processes never hold more memory than the cap
together, no file outside the sandbox's scratch changed (the course, and this repository's mha_lab/,
tests/hidden/, solutions/ and assignments/), none of its processes survive (each carries a marker in its
environment or argv), the loopback listener received nothing, and no feedback shows a hidden check, a solution
or a classmate's work. Whatever an attack writes into this repository (a file holding or naming its marker) is
put back afterwards.

Each assignment's checks are a class (``Attacked`` subclasses with their ``ASSIGNMENT``): pytest-xdist runs a class
whole in one worker (``--dist loadscope``), which grades that assignment's batch once.
"""

from __future__ import annotations

import hashlib
import html
import os
import re
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import pytest

from mha_lab.grading import course as courses
from mha_lab.instructor import classroom
from mha_lab.instructor.classroom import REPO, Attack, Student, Target

ATTACKS = classroom.attacks()
ASSIGNMENTS = sorted({a.assignment for a in ATTACKS})
TIMEOUT = 10  # seconds per submission, the grader's --timeout: an honest ps3 takes 1 to 1.6 s on a quiet machine
SETTLE = 3  # seconds a process killed with its sandbox may take to be gone
MEMORY = 2 * 2**30  # bytes per submission, the grader's default cap
LIMIT = 900  # seconds for one whole batch before it counts as stalled
PROTECTED = ("mha_lab", "tests/hidden", "solutions", "assignments")  # the folders of this repository the grader trusts
GRADER_OUTPUTS = re.compile(r"^(gradebook\.db.*|grades.*\.csv|feedback|autograded|reports|\.nbgrader\.log"
                            r"|dask-.*-space)$")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(LIMIT + 300)]


class Listener:
    """A TCP and a UDP socket on one loopback port, recording every byte anyone sends them."""

    def __init__(self) -> None:
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.port = self.tcp.getsockname()[1]
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", self.port))
        self.received: list[bytes] = []
        self.connections = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True),
                         threading.Thread(target=self._datagrams, daemon=True)]
        for t in self._threads:
            t.start()

    def _accept(self) -> None:
        self.tcp.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.tcp.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.settimeout(5)
                chunks = []
                try:
                    while chunk := conn.recv(1 << 16):
                        chunks.append(chunk)
                except OSError:
                    pass
                self.received.append(b"".join(chunks))

    def _datagrams(self) -> None:
        self.udp.settimeout(0.2)
        while not self._stop.is_set():
            try:
                self.received.append(self.udp.recv(1 << 16))
            except TimeoutError:
                continue
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        self.tcp.close()
        self.udp.close()


class MemoryWatch:
    """Samples twice a second the resident memory of all the processes that carry each marker; keeps the peak."""

    def __init__(self, markers: list[str]) -> None:
        self.peak = dict.fromkeys(markers, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        keys = {m: m.encode() for m in self.peak}
        while not self._stop.wait(0.5):
            total = dict.fromkeys(self.peak, 0)
            for pid, (argv, env, _) in _processes().items():
                owner = next((m for m, k in keys.items() if k in argv or k in env), None)
                if owner:
                    total[owner] += _rss(pid)
            for m, v in total.items():
                self.peak[m] = max(self.peak[m], v)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join(timeout=10)
        return self.peak


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return 0


def _files(root: Path, skip: re.Pattern | None = None) -> dict[str, str]:
    """relative path -> sha256 of every file under root (links by their target, not followed); iterative, as a
    submission's folders may be thousands of levels deep."""
    found, stack = {}, [Path(root)]
    while stack:
        folder = stack.pop()
        rel = folder.relative_to(root)
        try:
            with os.scandir(folder) as entries:
                items = list(entries)
        except OSError:  # a path longer than the system allows: as os.walk, leave it out
            continue
        stack += [Path(e.path) for e in items if e.is_dir(follow_symlinks=False) and e.name != "__pycache__"
                  and not (skip and rel == Path(".") and skip.match(e.name))]
        for name in (e.name for e in items if not e.is_dir(follow_symlinks=False)):
            if skip and rel == Path(".") and skip.match(name):
                continue
            path = Path(folder) / name
            if path.is_symlink():
                digest = "link:" + os.readlink(path)
            else:
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    while block := f.read(1 << 22):
                        h.update(block)
                digest = h.hexdigest()
            found[str(rel / name)] = digest
    return found


def _snapshot(course: Path) -> dict[str, dict[str, str]]:
    shot = {str(REPO / p): _files(REPO / p) for p in PROTECTED}
    shot[str(course)] = _files(course, skip=GRADER_OUTPUTS)
    return shot


def _remove_deep(root: Path) -> None:
    """Remove the chains of folders named ``deeper`` an attack left under ``root``: shutil.rmtree, which pytest
    cleans its folders with, would recurse past Python's limit."""
    for top in list(root.glob("*/*/deeper")):
        classroom.remove_tree(top)


def _changes(before: dict[str, dict[str, str]], after: dict[str, dict[str, str]]) -> list[str]:
    changed = []
    for root, files in before.items():
        now = after[root]
        changed += [f"{root}/{p}" for p in sorted(files.keys() | now.keys()) if files.get(p) != now.get(p)]
    return changed


def _containing(marker: str, paths: list[str]) -> list[str]:
    """The paths (changed files) that name ``marker`` or hold it."""
    found = []
    for p in paths:
        path = Path(p)
        if marker in path.name:
            found.append(p)
        elif path.is_file() and not path.is_symlink() and path.stat().st_size < 2**26:
            if marker.encode() in path.read_bytes():
                found.append(p)
    return found


def _backup() -> dict[Path, bytes]:
    return {p: p.read_bytes() for root in PROTECTED for p in (REPO / root).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def _restore(backup: dict[Path, bytes], written: list[str]) -> None:
    """Undo what attacks wrote into this repository (files that name or hold a marker); nothing else is touched."""
    for p in map(Path, written):
        if p in backup:
            p.write_bytes(backup[p])
        elif p.is_relative_to(REPO) and (p.is_file() or p.is_symlink()):
            p.unlink()


def _processes() -> dict[int, tuple[bytes, bytes, str]]:
    """pid -> (argv, environment, working directory) of every process this user can read."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read()
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:
            continue
        found[int(entry)] = (argv, env, cwd)
    return found


def _describe(pid: int, argv: bytes) -> str:
    return f"{pid} " + argv.replace(b"\0", b" ")[:200].decode(errors="replace")


def _marked(marker: str, procs: dict[int, tuple[bytes, bytes, str]]) -> list[str]:
    """The processes carrying ``marker`` in argv or environment, as 'pid argv'."""
    key = marker.encode()
    return [_describe(pid, argv) for pid, (argv, env, _) in procs.items() if key in argv or key in env]


def _in_course(course: Path, procs: dict[int, tuple[bytes, bytes, str]]) -> list[str]:
    """Processes still working in the course folder, or naming it in their argv."""
    path = str(course)
    return [_describe(pid, argv) for pid, (argv, _, cwd) in procs.items()
            if cwd == path or cwd.startswith(path + os.sep) or path.encode() in argv]


def _kill(lines: list[str]) -> None:
    for line in lines:
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except OSError:
            pass


def _planted(marker: str) -> list[Path]:
    """Files an attack may have left outside the course and the repository: in $HOME, /tmp and site-packages."""
    import site

    places = [Path.home() / marker, Path("/tmp") / marker]
    places += [Path(p) / f"{marker}.pth" for p in site.getsitepackages()]
    return [p for p in places if p.exists()]


def _text(path: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", path.read_text(errors="replace")))


def _code_lines(text: str) -> set[str]:
    """Lines long and specific enough that seeing one in feedback means the file leaked."""
    return {s for s in (ln.strip() for ln in text.splitlines()) if len(s) >= 25 and s[0] not in "\"'#"}


@dataclass
class Batch:
    """One graded class and everything observed around it."""

    assignment: str
    course: Path
    students: dict[str, Student]
    attacks: dict[str, Attack]
    markers: dict[str, str]
    secrets: dict[str, str]
    finished: bool = False
    returncode: int | None = None
    log: str = ""
    wall: float = 0.0
    rows: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    gradebook: dict[str, tuple[float, float]] = field(default_factory=dict)
    changed: list[str] = field(default_factory=list)
    survivors: dict[str, list[str]] = field(default_factory=dict)
    lingering: list[str] = field(default_factory=list)
    planted: dict[str, list[Path]] = field(default_factory=dict)
    written: dict[str, list[str]] = field(default_factory=dict)
    received: list[bytes] = field(default_factory=list)
    memory: dict[str, int] = field(default_factory=dict)
    connections: int = 0

    def feedback(self, student: str) -> str:
        folder = self.course / "feedback" / student / self.assignment
        return "".join(_text(p) for p in sorted(folder.glob("*.html"))) if folder.is_dir() else ""

    def submitted(self, student: str) -> str:
        """The code cells of the student's own notebook ('' when it is not a readable notebook)."""
        try:
            nb = nbformat.read(self.course / "submitted" / student / self.assignment / f"{self.assignment}.ipynb",
                               as_version=4)
        except Exception:  # noqa: BLE001 - a hostile notebook may be no notebook at all
            return ""
        return "\n".join(c.source for c in nb.cells if c.cell_type == "code")

    def where(self) -> str:
        return f"{self.assignment} batch ({self.wall:.0f} s, exit {self.returncode}); log tail:\n{self.log[-3000:]}"


def _gradebook(course: Path, assignment: str, students: list[str]) -> dict[str, tuple[float, float]]:
    from nbgrader.api import MissingEntry

    scores = {}
    if not (course / "gradebook.db").is_file():
        return scores
    with courses.gradebook(course) as gb:
        for s in students:
            try:
                sub = gb.find_submission(assignment, s)
            except MissingEntry:
                continue
            scores[s] = (float(sub.score), float(sub.max_score))
    return scores


def grade_batch(root: Path, assignment: str, scheduler: str) -> Batch:
    """The class graded by the real command on the Dask cluster at ``scheduler`` (shared with other tests: an
    attack that reached a worker would show there too)."""
    course = classroom.new_course(root / "course", [assignment])
    token = uuid.uuid4().hex[:8]
    secrets = {s: f"peer-secret-{token}-{s}" for s in ("honest-1", "honest-2")}
    students = {s: classroom.honest(course, s, assignment, secret) for s, secret in secrets.items()}
    students["blank"] = classroom.blank(course, "blank", assignment)
    students["buggy"] = classroom.buggy(course, "buggy", assignment, 0)
    listener = Listener()
    chosen = {f"attack-{a.name}": a for a in ATTACKS if a.assignment == assignment}
    markers = {s: f"mha-attack-{token}-{a.name}" for s, a in chosen.items()}
    for s, a in chosen.items():
        target = Target(markers[s], listener.port, str(course), str(REPO), os.getpid())
        students[s] = classroom.hostile(course, s, a, target)
    batch = Batch(assignment, course, students, chosen, markers, secrets)
    backup, before = _backup(), _snapshot(course)
    watch = MemoryWatch(list(markers.values()))
    try:
        proc, batch.wall = classroom.run_grader(course, assignment, jobs=2, timeout=TIMEOUT, limit=LIMIT,
                                                extra=["--memory", str(MEMORY), "--scheduler", scheduler])
        batch.finished = proc is not None
        if proc is not None:
            batch.returncode, batch.log = proc.returncode, proc.stdout + proc.stderr
        settled = time.monotonic() + SETTLE
        while True:  # until no attacker's process is left, or SETTLE has passed: what is left then survived
            procs = _processes()
            batch.survivors = {s: _marked(m, procs) for s, m in markers.items()}
            batch.lingering = _in_course(course, procs)
            if time.monotonic() > settled or not (any(batch.survivors.values()) or batch.lingering):
                break
            time.sleep(0.1)
        for lines in [*batch.survivors.values(), batch.lingering]:
            _kill(lines)
        batch.changed = _changes(before, _snapshot(course))
        batch.written = {s: _containing(m, batch.changed) for s, m in markers.items()}
        _restore(backup, [p for paths in batch.written.values() for p in paths])
        batch.planted = {s: _planted(m) for s, m in markers.items()}
    finally:
        _remove_deep(course / "submitted")
        peaks = watch.stop()
        listener.close()
        for paths in batch.planted.values():
            for p in paths:
                p.unlink(missing_ok=True)
    batch.received, batch.connections = listener.received, listener.connections
    batch.memory = {s: peaks[m] for s, m in markers.items()}
    for row in classroom.read_grades(course, assignment):
        batch.rows.setdefault(row["student"], []).append(row)
    batch.gradebook = _gradebook(course, assignment, list(students))
    return batch


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A class's attacks (``attack``): those on its assignment."""
    if "attack" in metafunc.fixturenames:
        chosen = [a for a in ATTACKS if a.assignment == metafunc.cls.ASSIGNMENT]
        metafunc.parametrize("attack", chosen, ids=[a.name for a in chosen])


@pytest.fixture(scope="class")
def batch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, grading_cluster) -> Batch:
    """The class's assignment graded as a batch, with everything observed around it."""
    return grade_batch(tmp_path_factory.mktemp(request.cls.ASSIGNMENT), request.cls.ASSIGNMENT,
                       grading_cluster.scheduler.address)


def _score(batch: Batch, student: str) -> tuple[float, float]:
    rows = batch.rows.get(student, [])
    assert len(rows) == 1, f"{student}: {len(rows)} rows in grades_{batch.assignment}.csv; {batch.where()}"
    return float(rows[0]["score"]), float(rows[0]["max_score"])


class Attacked:
    """The checks of one assignment's batch; a subclass per assignment names it (``ASSIGNMENT``)."""

    ASSIGNMENT = ""

    def test_batch_finishes_with_one_row_per_student(self, batch):
        assert batch.finished, f"the batch did not finish within {LIMIT} s; {batch.where()}"
        assert batch.returncode == 0, batch.where()
        assert sorted(batch.rows) == sorted(batch.students), batch.where()
        assert all(len(rows) == 1 for rows in batch.rows.values()), f"duplicated rows: {batch.where()}"

    def test_every_other_grade_is_exact(self, batch):
        assert batch.finished, batch.where()
        total = sum(classroom.points(classroom.read_notebook(batch.course, "solutions", self.ASSIGNMENT)).values())
        for name, s in batch.students.items():
            if s.kind == "hostile":
                continue
            assert _score(batch, name) == (s.expected, total), f"{name} ({s.kind}) in the CSV; {batch.where()}"
            assert batch.gradebook.get(name) == (s.expected, total), f"{name} ({s.kind}) in gradebook.db"

    def test_no_file_outside_the_scratch_changed(self, batch):
        assert not batch.changed, f"changed during the {self.ASSIGNMENT} batch: {batch.changed[:20]}"

    def test_no_process_outlives_the_batch(self, batch):
        leftover = [line for lines in batch.survivors.values() for line in lines] + batch.lingering
        assert not leftover, f"alive after the {self.ASSIGNMENT} batch: {leftover[:20]}"

    def test_the_listener_received_nothing(self, batch):
        assert batch.connections == 0 and not batch.received, (
            f"{batch.connections} connections, {sum(map(len, batch.received))} bytes: {batch.received[:1]!r:.300}")

    def test_no_feedback_shows_hidden_checks_solutions_or_peers(self, batch):
        release = classroom.read_notebook(batch.course, "assignments", self.ASSIGNMENT)
        handed_out = "\n".join(c.source for c in release.cells)  # what every student may see anyway
        hidden = {ln for ln in _code_lines((REPO / "tests" / "hidden" / f"test_{self.ASSIGNMENT}.py").read_text())
                  if ln not in handed_out}
        solution = classroom.read_notebook(batch.course, "solutions", self.ASSIGNMENT)
        answers = {ln for ln in _code_lines("\n".join(c.source for c in solution.cells
                                                      if c.metadata.get("nbgrader", {}).get("solution")))
                   if ln not in handed_out}
        for name, s in batch.students.items():
            text, own = batch.feedback(name), batch.submitted(name)  # a student may see what it wrote itself
            assert not [ln for ln in hidden if ln in text and ln not in own], f"{name}'s feedback shows tests/hidden/"
            if s.kind in ("blank", "hostile"):  # the others hand in (most of) the solution themselves
                shown = [ln for ln in answers if ln in text and ln not in own]
                assert not shown, f"{name}'s feedback shows the solution"
            peers = [secret for peer, secret in batch.secrets.items() if peer != name]
            assert not [p for p in peers if p in text], f"{name}'s feedback shows a classmate's notebook"

    def test_attack_is_contained(self, batch, attack):
        """Everything this attack could have done, checked for this attack alone; its score last."""
        student = f"attack-{attack.name}"
        marker = batch.markers[student]
        assert batch.finished, f"{attack.name}: the batch did not finish; {batch.where()}"
        held = batch.memory[student]
        assert held <= MEMORY + 2**26, f"{attack.name}: its processes held {held / 2**30:.1f} GiB at once, over the cap"
        assert not batch.survivors[student], f"{attack.name}: alive after the batch: {batch.survivors[student]}"
        assert not [r for r in batch.received if marker.encode() in r], f"{attack.name} reached the loopback listener"
        assert not batch.planted[student], f"{attack.name} left files behind: {batch.planted[student]}"
        assert not batch.written[student], f"{attack.name} wrote outside its scratch: {batch.written[student]}"
        score, _ = _score(batch, student)
        deserved = batch.students[student].expected  # the blank release's 0, or what its honest part earns
        assert score <= deserved, f"{attack.name} ({attack.summary}) scored {score} in the CSV; it deserves {deserved}"
        assert batch.gradebook.get(student, (0.0, 0.0))[0] <= deserved, f"{attack.name} scored more in gradebook.db"


class TestPs1PerHeadLoop(Attacked):
    ASSIGNMENT = "ps1_per_head_loop"


class TestPs2Mqa(Attacked):
    ASSIGNMENT = "ps2_mqa"


class TestPs3MemoryEfficient(Attacked):
    ASSIGNMENT = "ps3_memory_efficient"


class TestPs4Backward(Attacked):
    ASSIGNMENT = "ps4_backward"


class TestPs5Decoding(Attacked):
    ASSIGNMENT = "ps5_decoding"


def test_every_assignment_attacked_has_its_class():
    assert sorted(c.ASSIGNMENT for c in Attacked.__subclasses__()) == ASSIGNMENTS
