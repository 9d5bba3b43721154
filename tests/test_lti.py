"""LTI 1.3 grade passback (``python -m mha_lab export --lti``) against a platform built on ``lti1p3platform``:
its token endpoint (client credentials with a signed assertion) and its AGS and NRPS services, served on
127.0.0.1. The library leaves storage and HTTP to its user; the store below is a dict and the server is
``http.server``. Two gaps of the library are worked around by the client, and shown here: its line-item and
result containers are paginated objects (``{"content": [...]}``) where LTI sends an array, and it checks
neither the client assertion's nor the token's audience.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import io
import json
import re
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from mha_lab.instructor import export, lms, lti

ltiplatform = pytest.importorskip("lti1p3platform.ltiplatform")
from lti1p3platform.registration import Registration as PlatformRegistration  # noqa: E402
from lti1p3platform.request import Request  # noqa: E402
from lti1p3platform.score import UpdateScoreStatus  # noqa: E402
from lti1p3platform.service_connector import (  # noqa: E402
    AssignmentsGradesService,
    NamesRoleProvisioningService,
)

pytestmark = pytest.mark.timeout(120)

LEARNER = "http://purl.imsglobal.org/vocab/lis/v2/membership#Learner"
TEACHER = "http://purl.imsglobal.org/vocab/lis/v2/membership#Instructor"


@functools.cache
def _pem(n: int = 0) -> tuple[str, str]:
    """Key pair number ``n`` (the tool's is 0, the platform's 1), made once per test run."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode()
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    return private, public


@dataclass
class Store:
    """The platform's state: the roster, line items, scores, and faults to inject into score posts."""

    members: list[dict]
    lineitems: dict[str, dict] = field(default_factory=dict)
    scores: dict[str, dict[str, dict]] = field(default_factory=dict)  # line item id -> user -> last score
    ok_scores: int | None = None  # score posts that succeed before every later one fails with a 500
    busy: int = 0  # score posts answered 503 or 429 (alternately), counted down, before they succeed
    log: list[str] = field(default_factory=list)
    raw: dict[str, tuple[int, dict[str, str], bytes]] = field(default_factory=dict)  # path?query -> a reply as is


class _Conf(ltiplatform.LTI1P3PlatformConfAbstract):
    def init_platform_config(self, registration: PlatformRegistration) -> None:
        self._registration = registration

    def get_registration_by_params(self, **kwargs: object) -> PlatformRegistration:
        return self._registration


class _Request(Request):
    def build_metadata(self, request: dict) -> dict:
        return request


def _page(items: list[dict]) -> dict:
    return {"content": items, "has_next": False, "next": None}


class _Grades(AssignmentsGradesService):
    store: Store
    base: str

    def find_lineitems(self, page=1, limit=None, line_item_id=None, resource_link_id=None, resource_id=None,
                       tag=None) -> dict:
        items = [i for i in self.store.lineitems.values() if (resource_id is None or i["resourceId"] == resource_id)
                 and (tag is None or i.get("tag") == tag)]
        return _page(items)

    def find_lineitem(self, line_item_id: str) -> dict:
        return self.store.lineitems[f"{self.base}/lineitems/{line_item_id}"]

    def create_lineitem(self, creation_data: dict) -> dict:
        item = {**creation_data, "id": f"{self.base}/lineitems/{len(self.store.lineitems) + 1}"}
        self.store.lineitems[item["id"]] = item
        return item

    def update_lineitem(self, update_data: dict) -> dict:
        raise NotImplementedError

    def delete_lineitem(self, line_item_id: str) -> None:
        raise NotImplementedError

    def update_score(self, line_item_id: str, score: dict) -> UpdateScoreStatus:
        self.store.scores.setdefault(f"{self.base}/lineitems/{line_item_id}", {})[score["userId"]] = score
        return UpdateScoreStatus.SUCCESS

    def get_results(self, line_item_id: str, page=1, limit=None, user_id=None) -> dict:
        item = f"{self.base}/lineitems/{line_item_id}"
        return _page([{"id": f"{item}/results/{u}", "userId": u, "resultScore": s.get("scoreGiven"),
                       "resultMaximum": s["scoreMaximum"], "scoreOf": item}
                      for u, s in self.store.scores.get(item, {}).items()])


class _Roster(NamesRoleProvisioningService):
    store: Store

    def get_member_data_page(self, page=1, limit=None, role=None, since=None) -> dict:
        return _page([dict(m) for m in self.store.members])

    def get_context_by_id(self):
        from lti1p3platform.membership import Context

        return Context(id="course-7", label="MHA", title="Multi-head attention")


class Platform:
    """An LTI 1.3 platform on 127.0.0.1 with one tool registered (``tool_public_key``)."""

    def __init__(self, store: Store, tool_public_key_set: dict) -> None:
        self.store = store
        private, public = _pem(1)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.registration = (PlatformRegistration().set_iss(self.url).set_client_id("tool-1")
                             .set_deployment_id("deploy-1").set_platform_public_key(public)
                             .set_platform_private_key(private).set_tool_key_set(tool_public_key_set))
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)

    def __enter__(self) -> Platform:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        platform = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _answer(self, code: int, body: object, media: str = "application/json") -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", media)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self, method: str) -> None:
                parts = urlsplit(self.path)
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                platform.store.log.append(f"{method} {parts.path}")
                if self.path in platform.store.raw:  # a hostile platform's reply, sent byte for byte
                    code, headers, body = platform.store.raw[self.path]
                    self.send_response(code)
                    for name, value in {"Content-Length": str(len(body)), **headers}.items():
                        self.send_header(name, value)
                    self.end_headers()
                    with contextlib.suppress(OSError):  # the client may hang up once it has read enough
                        self.wfile.write(body)
                    return
                request = _Request({"method": method, "path": parts.path, "headers": dict(self.headers),
                                    "get_data": dict(parse_qsl(parts.query)), "content_type": self.headers.get(
                                        "Content-Type"), "form_data": dict(parse_qsl(raw.decode())),
                                    "json": json.loads(raw) if raw and "json" in (self.headers.get(
                                        "Content-Type") or "") else None})
                conf = _Conf(registration=platform.registration)
                if parts.path == "/token":
                    try:
                        return self._answer(200, conf.get_access_token(request.form_data))
                    except Exception as exc:  # noqa: BLE001 - a refused client, as a platform answers it
                        return self._answer(401, {"error": "invalid_client", "detail": str(exc)})
                match = re.fullmatch(r"/lineitems(?:/(\d+))?(/scores|/results)?", parts.path)
                if parts.path == "/memberships":
                    service = _Roster(request, conf, f"{platform.url}/memberships")
                    service.store = platform.store
                    call = service.handle_get_members
                elif match:
                    service = _Grades(request, conf, f"{platform.url}/lineitems")
                    service.store, service.base = platform.store, platform.url
                    number, tail = match.groups()
                    if tail == "/scores" and platform.store.busy:
                        platform.store.busy -= 1
                        code = 429 if platform.store.busy % 2 else 503
                        return self._answer(code, {"error": "busy"})
                    if tail == "/scores" and platform.store.ok_scores is not None:
                        if platform.store.ok_scores == 0:
                            return self._answer(500, {"error": "failure"})
                        platform.store.ok_scores -= 1
                    call = {(None, "GET"): service.handle_get_lineitems, (None, "POST"): service.handle_create_lineitem,
                            ("/scores", "POST"): lambda: service.handle_update_score(number),
                            ("/results", "GET"): lambda: service.handle_get_results(number)}.get((tail, method))
                else:
                    call = None
                if call is None:
                    return self._answer(404, {"error": "no such endpoint"})
                try:
                    reply = call()
                except Exception as exc:  # noqa: BLE001 - a token that does not verify
                    return self._answer(401, {"error": str(exc)})
                self._answer(reply.code, reply.result, reply.media_type)

            def do_GET(self) -> None:  # noqa: N802
                self._route("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._route("POST")

        return Handler


def _members() -> list[dict]:
    people = [("u1", "ana", LEARNER), ("u2", "ben", LEARNER), ("u3", "cat", LEARNER), ("u4", "dan", LEARNER),
              ("u9", "zed", LEARNER), ("t1", "prof", TEACHER)]
    return [{"user_id": u, "lis_person_sourcedid": sis, "roles": [role], "status": "Active"}
            for u, sis, role in people]


def _grades(ana: float = 19.8) -> dict[tuple[str, str], lms.Grade]:
    a = "ps2_mqa"
    return {("ana", a): lms.Grade("ana", a, "graded", ana, 22.0, 2.2, 24.0),
            ("ben", a): lms.Grade("ben", a, "not submitted", max_score=24.0),
            ("cat", a): lms.Grade("cat", a, "not graded", max_score=24.0),
            ("dan", a): lms.Grade("dan", a, "graded", 24.0, 24.0, 0.0, 24.0),
            ("eve", a): lms.Grade("eve", a, "graded", 12.0, 12.0, 0.0, 24.0)}


@pytest.fixture
def tool(tmp_path: Path) -> tuple[str, dict]:
    private, _ = _pem()
    (tmp_path / "tool.pem").write_text(private)
    return "tool.pem", lti.public_key_set(lti.Registration("tool-1", "deploy-1", "", private, "k1", "", ""))


@pytest.fixture
def platform(tool: tuple[str, dict]) -> Iterator[Platform]:
    with Platform(Store(_members()), tool[1]) as p:
        yield p


def _config(tmp_path: Path, platform: Platform, key: str = "tool.pem", **extra: object) -> Path:
    lines = {"client_id": "tool-1", "deployment_id": "deploy-1", "token_url": f"{platform.url}/token",
             "private_key": key, "key_id": "k1", "lineitems_url": f"{platform.url}/lineitems",
             "memberships_url": f"{platform.url}/memberships", "issuer": platform.url, "backoff": 0.01, **extra}
    path = tmp_path / "lti.toml"
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in lines.items()))
    return path


def _export(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, grades: dict, *args: str) -> int:
    monkeypatch.setattr(export, "read_grades", lambda course: grades)
    return export.main(["--course", str(tmp_path), *args])


def _read_back(platform: Platform, tmp_path: Path) -> dict[str, dict[str, float | None]]:
    """resourceId -> LTI user -> resultScore, read through the platform's own AGS endpoints."""
    client = lti.Client(lti.load(_config(tmp_path, platform)))
    return {item["resourceId"]: {r["userId"]: r["resultScore"] for r in client.results(item["id"])}
            for item in platform.store.lineitems.values()}


def test_round_trip_posts_final_scores_once_and_updates_them(platform, tmp_path, monkeypatch, capsys):
    config = _config(tmp_path, platform)
    assert _export(monkeypatch, tmp_path, _grades(), "--lti", str(config), "ps2_mqa") == 0
    out = capsys.readouterr().out
    assert "posted ps2_mqa ana: 19.8" in out and "created the line item of ps2_mqa" in out
    assert "graded but not on the platform's roster: eve" in out  # reported, never guessed
    assert "learners on the roster that match no student: u9" not in out  # zed: on the roster, no grade row
    (item,) = platform.store.lineitems.values()
    assert (item["resourceId"], item["tag"], item["scoreMaximum"]) == ("ps2_mqa", "mha_lab", 24.0)
    assert _read_back(platform, tmp_path) == {"ps2_mqa": {"u1": 19.8, "u4": 24.0}}  # ben, cat: nothing, not 0
    posted = platform.store.scores[item["id"]]["u1"]
    assert (posted["activityProgress"], posted["gradingProgress"]) == ("Completed", "FullyGraded")

    assert _export(monkeypatch, tmp_path, _grades(ana=21.0), "--lti", str(config)) == 0  # a regrade
    assert len(platform.store.lineitems) == 1  # found by resourceId and tag, not created again
    assert _read_back(platform, tmp_path) == {"ps2_mqa": {"u1": 21.0, "u4": 24.0}}


def test_dry_run_sends_nothing_even_with_the_platform_up(platform, tmp_path, monkeypatch, capsys):
    assert _export(monkeypatch, tmp_path, _grades(), "--lti", str(_config(tmp_path, platform)), "--dry-run") == 0
    assert "would post ps2_mqa ana: 19.8" in capsys.readouterr().out
    assert platform.store.log == []  # no token request, no roster, no line item


def test_a_token_signed_with_the_wrong_key_is_refused(platform, tmp_path, monkeypatch, capsys):
    (tmp_path / "other.pem").write_text(_pem(2)[0])
    config = _config(tmp_path, platform, key="other.pem")
    assert _export(monkeypatch, tmp_path, _grades(), "--lti", str(config)) == 1
    assert "/token: 401" in capsys.readouterr().err
    assert platform.store.lineitems == {} and platform.store.scores == {}


def test_a_platform_failing_half_way_is_finished_by_a_second_run(platform, tmp_path, monkeypatch, capsys):
    config = _config(tmp_path, platform, retries=1)
    platform.store.ok_scores = 1  # ana's score goes through, then the platform fails every score
    assert _export(monkeypatch, tmp_path, _grades(), "--lti", str(config)) == 1
    err = capsys.readouterr().err
    assert "FAILED ps2_mqa dan" in err and "run the same command again" in err
    assert _read_back(platform, tmp_path) == {"ps2_mqa": {"u1": 19.8}}
    platform.store.ok_scores = None
    assert _export(monkeypatch, tmp_path, _grades(), "--lti", str(config)) == 0
    assert len(platform.store.lineitems) == 1
    assert _read_back(platform, tmp_path) == {"ps2_mqa": {"u1": 19.8, "u4": 24.0}}


def test_busy_replies_are_retried_with_back_off(platform, tmp_path):
    platform.store.busy = 3  # 503, 429, 503 before the first score goes through
    client = lti.Client(lti.load(_config(tmp_path, platform)), log=lambda line: None)
    out = lti.post_grades(client, _grades(), ["ps2_mqa"])
    assert out.failed == [] and [s for s, _, _ in out.posted] == ["ana", "dan"]
    assert sum(entry.endswith("/scores") for entry in platform.store.log) == 2 + 3


def test_pending_and_an_ambiguous_roster(platform, tmp_path):
    platform.store.members.append({"user_id": "u5", "lis_person_sourcedid": "dan", "roles": [LEARNER]})
    client = lti.Client(lti.load(_config(tmp_path, platform, pending=True)))
    out = lti.post_grades(client, _grades(), ["ps2_mqa"])
    assert out.unmatched_members == ["u4", "u5"] and "dan" in out.unmatched_students  # two "dan"s: no one
    (item,) = platform.store.scores.values()
    assert set(item) == {"u1", "u3"}
    assert item["u3"]["gradingProgress"] == "Pending" and "scoreGiven" not in item["u3"]  # cat: not graded
    assert ("ben", "ps2_mqa", "not submitted") in out.skipped


def test_config_errors_name_the_key(tmp_path):
    (tmp_path / "bad.toml").write_text('client_id = "x"\ncolour = "red"\n')
    with pytest.raises(ValueError, match="missing deployment_id.*unknown colour"):
        lti.load(tmp_path / "bad.toml")


def test_jwks_is_the_public_half_of_the_configured_key(platform, tmp_path, capsys, tool):
    assert export.main(["--lti-jwks", str(_config(tmp_path, platform))]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == tool[1] and "d" not in printed["keys"][0]  # no private exponent


# A platform that cannot be trusted: replies too large once inflated, URLs on other origins, plain http, and a
# dry run that must reach nothing at all.

README = Path(__file__).resolve().parents[1] / "README.md"
MEMBERS = "application/vnd.ims.lti-nrps.v2.membershipcontainer+json"


@pytest.fixture
def elsewhere() -> Iterator[tuple[str, list[tuple[str, str | None]]]]:
    """A server on a second loopback address, 127.0.0.2, that records each request and its Authorization."""
    seen: list[tuple[str, str | None]] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _record(self) -> None:
            seen.append((f"{self.command} {self.path}", self.headers.get("Authorization")))
            body = json.dumps({"members": _members()}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _record  # noqa: N815

    server = ThreadingHTTPServer(("127.0.0.2", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.2:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("how", ["Link header", "next in the body", "redirect"])
def test_a_url_on_another_origin_is_refused_and_gets_no_token(platform, elsewhere, tmp_path, monkeypatch, capsys,
                                                               how):
    url, seen = elsewhere
    foreign = f"{url}/memberships?page=2"
    page = {"members": _members()[:2], **({"next": foreign} if how == "next in the body" else {})}
    headers = {"Link": f'<{foreign}>; rel="next"'} if how == "Link header" else {}
    platform.store.raw["/memberships"] = ((302, {"Location": foreign}, b"") if how == "redirect"
                                          else (200, {"Content-Type": MEMBERS, **headers}, json.dumps(page).encode()))
    assert _export(monkeypatch, tmp_path, _grades(), "--lti", str(_config(tmp_path, platform)), "ps2_mqa") == 1
    err = capsys.readouterr().err
    assert foreign in err and ("not on the platform's origin" in err or "redirected (302)" in err), err
    assert seen == []  # not one request, so no token either
    assert platform.store.lineitems == {} and platform.store.scores == {}


def test_a_line_item_on_another_origin_gets_no_score(platform, elsewhere, tmp_path):
    url, seen = elsewhere
    item = {"id": f"{url}/lineitems/1", "resourceId": "ps2_mqa", "tag": "mha_lab", "label": "ps2_mqa",
            "scoreMaximum": 24.0}
    platform.store.lineitems[item["id"]] = item
    client = lti.Client(lti.load(_config(tmp_path, platform)), log=lambda line: None)
    with pytest.raises(lti.LtiError, match=re.escape(f"line item URL of ps2_mqa ({url}/lineitems/1)")):
        lti.post_grades(client, _grades(), ["ps2_mqa"])
    assert seen == []


def test_a_reply_cut_short_is_tried_again_then_named(platform, tmp_path, monkeypatch, capsys):
    platform.store.raw["/memberships"] = (200, {"Content-Length": "100000"}, b'{"members": [')
    assert _export(monkeypatch, tmp_path, _grades(), "--lti", str(_config(tmp_path, platform, retries=1))) == 1
    assert "/memberships: no connection (ProtocolError)" in capsys.readouterr().err
    assert platform.store.log.count("GET /memberships") == 2


def test_next_links_on_the_platform_are_followed_and_gzip_is_read(platform, tmp_path, monkeypatch):
    members = _members()
    first = json.dumps({"members": members[:3]}).encode()
    platform.store.raw["/memberships"] = (200, {"Link": '</memberships?page=2>; rel="next"'}, first)  # relative
    second = gzip.compress(json.dumps({"members": members[3:]}).encode())
    platform.store.raw["/memberships?page=2"] = (200, {"Content-Encoding": "gzip"}, second)
    client = lti.Client(lti.load(_config(tmp_path, platform)))
    assert [m["user_id"] for m in client.members()] == [m["user_id"] for m in members]
    monkeypatch.setattr(lti, "MAX_VALUES", lti._values(first) + 10)  # each page fits, the two together do not
    with pytest.raises(lti.LtiError, match="pages of .*/memberships hold more than .* JSON values together"):
        client.members()


@functools.cache
def _bomb() -> bytes:
    """About 1 MB of gzip that inflates to 1 GiB of zeros: 64 gzip members of 16 MiB each, one after another."""
    return gzip.compress(bytes(16 << 20)) * 64


HOSTILE_CLIENT = """
import dataclasses, json, sys
from mha_lab.instructor import lti

def mib(field):
    return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1]) / 1024

reg = lti.load(sys.argv[1])
seen = {}
for case in sys.argv[2:]:
    client = lti.Client(dataclasses.replace(reg, memberships_url=f"{reg.memberships_url}?{case}"), log=print)
    client.token()
    open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
    before = mib("VmRSS:")
    try:
        client.members()
        error = ""
    except lti.LtiError as exc:
        error = str(exc)
    seen[case] = {"growth_mib": mib("VmHWM:") - before, "error": error}
print(json.dumps(seen))
"""


def test_replies_too_big_once_inflated_or_parsed_are_refused_within_bounded_memory(platform, tmp_path):
    """The client's peak RSS may grow by 1.5 times the reply limit (16 MiB) plus 8 MiB while it refuses a 1 MB
    gzip reply that inflates to 1 GiB (read whole, it grew by about 2 GiB), or a 16 MiB reply of 5.6 million
    empty objects (parsed, it grew by 428 MiB)."""
    bomb = _bomb()
    assert len(bomb) < 1.1e6
    platform.store.raw["/memberships?bomb"] = (200, {"Content-Type": MEMBERS, "Content-Encoding": "gzip"}, bomb)
    flood = b'{"members": [' + b"{}," * ((lti.MAX_BODY - 20) // 3) + b"{}]}"
    platform.store.raw["/memberships?flood"] = (200, {"Content-Type": MEMBERS}, flood)
    run = subprocess.run([sys.executable, "-c", HOSTILE_CLIENT, str(_config(tmp_path, platform)), "bomb", "flood"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout)
    assert "inflates past 16777216 bytes" in seen["bomb"]["error"]
    assert "more than 1048576 JSON values" in seen["flood"]["error"]
    for case in seen.values():
        assert case["growth_mib"] < 1.5 * 16 + 8, seen


@pytest.mark.parametrize("url, fine", [("https://lms.example.edu", True), ("http://localhost:8080", True),
                                       ("http://127.0.0.2", True), ("http://[::1]:8080", True),
                                       ("http://lms.example.edu", False), ("http://127.0.0.1.example.edu", False)])
def test_https_is_required_except_on_a_loopback_host(url, fine):
    reg = lti.Registration("c", "d", f"{url}/token", _pem()[0], "k", f"{url}/lineitems", f"{url}/memberships")
    if fine:
        lti.Client(reg)
    else:
        with pytest.raises(lti.LtiError, match=r"token_url .*plain http.*use https.*--allow-http"):
            lti.Client(reg)
    lti.Client(reg, allow_http=True)  # the explicit choice


def test_a_url_with_a_user_name_is_not_an_endpoint():
    url = "https://lms.example.edu@elsewhere.example"
    reg = lti.Registration("c", "d", f"{url}/token", _pem()[0], "k", f"{url}/lineitems", f"{url}/memberships")
    with pytest.raises(lti.LtiError, match="token_url .*not a plain http"):
        lti.Client(reg)


def _readme_config(tmp_path: Path, **replace: str) -> Path:
    """The README's lti.toml, its URLs kept (nothing answers there), with the tool's key beside it."""
    block = re.search(r"```toml\n(# lti\.toml.*?)```", README.read_text(), re.S).group(1)
    for old, new in replace.items():
        block = block.replace(old, new)
    (tmp_path / "tool_private.pem").write_text(_pem()[0])
    (tmp_path / "lti.toml").write_text(block)
    return tmp_path / "lti.toml"


def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"the dry run reached for the network: {args}")

    import socket

    for name in ("getaddrinfo", "create_connection"):
        monkeypatch.setattr(socket, name, refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


def _in_order(out: str, *starts: str) -> list[int]:
    """The line number of the first line that begins with each of ``starts``."""
    lines = out.splitlines()
    return [next((i for i, line in enumerate(lines) if line.startswith(s)), -1) for s in starts]


def test_dry_run_contacts_nothing_and_says_the_plan_in_order(tmp_path, monkeypatch, capsys):
    _no_network(monkeypatch)
    start = time.monotonic()
    assert _export(monkeypatch, tmp_path, _grades(), "--lti", str(_readme_config(tmp_path)), "--dry-run") == 0
    assert time.monotonic() - start < 5
    out = capsys.readouterr().out
    steps = _in_order(out, "would request a token from https://canvas.example.edu/login/oauth2/token",
                      "would read the roster from https://canvas.example.edu/api/lti/courses/7/names_and_roles",
                      "would find the line item of ps2_mqa", "would post ps2_mqa ana: 19.8",
                      "would post ps2_mqa dan: 24")
    assert -1 not in steps and steps == sorted(steps), out

    http = _readme_config(tmp_path, **{"https://canvas": "http://canvas"})
    assert _export(monkeypatch, tmp_path, _grades(), "--lti", str(http), "--dry-run") == 1
    assert "plain http" in capsys.readouterr().err
    assert _export(monkeypatch, tmp_path, _grades(), "--lti", str(http), "--dry-run", "--allow-http") == 0


ROSTERS = {"roster.json": json.dumps({"id": "https://canvas.example.edu/api/lti/courses/7/names_and_roles",
                                      "context": {"id": "course-7"},
                                      "members": [*_members(), {"user_id": "u7", "roles": [LEARNER]}]}),
           "roster.csv": "user_id,lis_person_sourcedid,roles\nu1,ana,Learner\nu4,dan,\nu7,,Learner\n"
                         "t1,prof,Instructor\n"}


@pytest.mark.parametrize("name", sorted(ROSTERS))
def test_dry_run_matches_a_roster_file(tmp_path, monkeypatch, capsys, name):
    _no_network(monkeypatch)
    (tmp_path / name).write_text(ROSTERS[name])
    config = str(_readme_config(tmp_path))
    roster = str(tmp_path / name)
    assert _export(monkeypatch, tmp_path, _grades(), "--lti", config, "--dry-run", "--roster", roster) == 0
    out = capsys.readouterr().out
    steps = _in_order(out, "would request a token", "would find the line item of ps2_mqa",
                      "would post ps2_mqa ana: 19.8 (to u1)", "would post ps2_mqa dan: 24 (to u4)")
    assert -1 not in steps and steps == sorted(steps), out
    assert "would read the roster" not in out and "would post ps2_mqa eve" not in out
    assert "graded but not on the roster file: eve" in out and "match no student: u7" in out


def test_a_roster_file_without_the_match_column_is_refused(tmp_path, monkeypatch, capsys):
    (tmp_path / "roster.csv").write_text("user_id,email\nu1,ana@example.edu\n")
    config = str(_readme_config(tmp_path))
    assert _export(monkeypatch, tmp_path, _grades(), "--lti", config, "--dry-run", "--roster",
                   str(tmp_path / "roster.csv")) == 1
    assert "no column lis_person_sourcedid" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _export(monkeypatch, tmp_path, _grades(), "--lti", config, "--roster", str(tmp_path / "roster.csv"))


class _Wire(io.BytesIO):
    """A reply's undecoded bytes as urllib3 hands them over, ``delay`` seconds per read."""

    def __init__(self, data: bytes, delay: float = 0.0) -> None:
        super().__init__(data)
        self.delay = delay

    def read1(self, size: int = -1, decode_content: bool = True) -> bytes:
        assert decode_content is False  # the client inflates, within its limit, not urllib3
        time.sleep(self.delay)
        return super().read1(min(size, 1000) if self.delay else size)


BODY = json.dumps({"members": _members()}).encode()


@pytest.mark.parametrize("encoding, wire, delay, limit, expect", [
    ("gzip", gzip.compress(BODY[:50]) + gzip.compress(BODY[50:]), 0, 1 << 20, BODY),  # two gzip members
    ("deflate", zlib.compress(BODY), 0, 1 << 20, BODY),
    ("", BODY, 0, len(BODY), BODY),
    ("", BODY, 0, len(BODY) - 1, "more than"),
    ("gzip", gzip.compress(BODY), 0, len(BODY) - 1, "inflates past"),
    ("gzip", gzip.compress(BODY)[:-12], 0, 1 << 20, "ends early"),
    ("gzip", b"not gzip at all", 0, 1 << 20, "does not inflate"),
    ("br", BODY, 0, 1 << 20, "'br', which is not accepted"),
    ("", bytes(5000), 0.05, 1 << 20, "longer than the timeout"),  # a platform that drips its reply
])
def test_a_reply_is_read_within_its_limits(encoding, wire, delay, limit, expect):
    read = functools.partial(lti._read_body, _Wire(wire, delay), encoding, limit, time.monotonic() + 0.15, "GET x")
    if isinstance(expect, bytes):
        assert read() == expect
    else:
        with pytest.raises(lti.LtiError, match=re.escape(expect)):
            read()
