"""Final scores to the LMS over LTI 1.3 Assignment and Grade Services (AGS), roster from Names and Role
Provisioning (NRPS): ``python -m mha_lab export --lti CONFIG A...``.

The tool (this course) authenticates with the OAuth 2 client-credentials grant, signing its request with its
own private key (IMS Security Framework: a JWT ``client_assertion``, RS256, ``kid`` in its header). Then:

1. the roster: the context's memberships (NRPS, every page); learners are matched to nbgrader ids by one
   configurable field (``lis_person_sourcedid``, ``email``, ...). Unmatched students on either side are
   reported, never guessed; a value shared by two members matches no one.
2. one line item per assignment, found by its ``resourceId`` and ``tag`` before one is created, so a second
   run never adds a column; ``scoreMaximum`` is the assignment's.
3. one score per matched student whose submission was graded: the final score (after the late penalty),
   ``activityProgress`` Completed, ``gradingProgress`` FullyGraded. Not graded or not submitted: nothing is
   posted (with ``pending = true``: a score with no ``scoreGiven`` and ``gradingProgress`` Pending), never 0.

Requests that meet a 429 or a 5xx are retried with exponential back-off (``Retry-After`` honoured, capped).
A score is a replacement, not an increment, so a run that failed part-way is finished by running it again.
Each step is said as it is done; a dry run (``Client(dry_run=True)``) sends nothing at all, not even the token
request, and says the same steps in the same order, matched against a roster file when one is given
(``read_roster``).

Nothing the platform sends is trusted. Every reply is read in chunks of ``CHUNK`` bytes and refused once it
passes ``MAX_BODY`` bytes, counted after decompression (a gzip reply is inflated a chunk at a time, never
whole), or once reading it takes longer than ``timeout``; it is parsed only if it holds at most
``MAX_VALUES`` JSON values, and the pages of one listing together may hold ``MAX_LISTING`` bytes and
``MAX_VALUES`` values. The access token goes only to the platform's origin: the scheme, host and port of the
configured service endpoints (``lineitems_url``, ``memberships_url``). A paging link (``Link: rel="next"``),
a line item's URL or a redirect that names another origin is refused, with an error naming it, before
anything is sent there. Every endpoint must be ``https`` unless its host is a loopback address (127.0.0.0/8,
``::1``, ``localhost``) or ``allow_http`` is set (``--allow-http``). Platform text in messages is escaped.

CONFIG is a TOML file::

    client_id = "..."                    # the tool's client id at the platform
    deployment_id = "..."
    token_url = "https://lms.example.edu/login/oauth2/token"
    private_key = "tool_private.pem"      # the tool's RSA key; relative to CONFIG's folder
    key_id = "mha-lab-1"                  # its kid, as registered with the platform's copy of the key
    lineitems_url = "https://lms.example.edu/api/lti/courses/7/line_items"
    memberships_url = "https://lms.example.edu/api/lti/courses/7/names_and_roles"
    # optional
    issuer = "https://lms.example.edu"    # the platform, for messages
    audience = "..."                      # the client assertion's aud (default: token_url)
    match = "lis_person_sourcedid"        # the member field that holds the nbgrader student id
    pending = false                       # post "Pending" for students with no grade
    tag = "mha_lab"                       # marks the line items this tool owns
    retries = 4                           # tries after the first on a 429 or 5xx
    backoff = 1.0                         # seconds before the first retry, doubled each time
    timeout = 30.0                        # seconds per request, its reply's body included

The platform needs the tool's public key: ``python -m mha_lab export --lti-jwks CONFIG`` prints it as a key set.
"""

from __future__ import annotations

import csv
import io
import ipaddress
import json
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit, urlunsplit

import jwt
import requests
import tomllib
import urllib3
from cryptography.hazmat.primitives import serialization
from urllib3.util import parse_url

from mha_lab.instructor.lms import Grade

__all__ = ["Registration", "LtiError", "Outcome", "load", "public_key_set", "Client", "post_grades", "read_roster",
           "MAX_BODY"]

SCOPES = ("https://purl.imsglobal.org/spec/lti-ags/scope/lineitem",
          "https://purl.imsglobal.org/spec/lti-ags/scope/result.readonly",
          "https://purl.imsglobal.org/spec/lti-ags/scope/score",
          "https://purl.imsglobal.org/spec/lti-nrps/scope/contextmembership.readonly")
LINEITEM = "application/vnd.ims.lis.v2.lineitem+json"
LINEITEMS = "application/vnd.ims.lis.v2.lineitemcontainer+json"
SCORE = "application/vnd.ims.lis.v1.score+json"
RESULTS = "application/vnd.ims.lis.v2.resultcontainer+json"
MEMBERS = "application/vnd.ims.lti-nrps.v2.membershipcontainer+json"
MAX_BODY = 16 << 20  # bytes of one reply from the platform, after decompression
MAX_LISTING = 4 * MAX_BODY  # bytes of every page of one listing (the roster) together; also a roster file's
MAX_VALUES = 1 << 20  # JSON values and keys of one reply, and of every page of a listing together
CHUNK = 64 << 10  # bytes read from the connection at a time
MAX_PAGES = 1000
REQUIRED = ("client_id", "deployment_id", "token_url", "private_key", "key_id", "lineitems_url", "memberships_url")
ENDPOINTS = ("token_url", "lineitems_url", "memberships_url")
WBITS = {"": 0, "identity": 0, "gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
MEMBER_FIELDS = ("user_id", "roles", "status")  # what the matching reads of a member, with the match field

Origin = tuple[str, str, int]  # scheme, host, port


class LtiError(RuntimeError):
    """The platform refused or failed a request, or sent what the client does not accept; the message names it."""


@dataclass(frozen=True)
class Registration:
    """The tool's registration with one platform, for one course context (see the module's CONFIG)."""

    client_id: str
    deployment_id: str
    token_url: str
    private_key: str  # PEM text
    key_id: str
    lineitems_url: str
    memberships_url: str
    issuer: str = ""
    audience: str = ""
    match: str = "lis_person_sourcedid"
    pending: bool = False
    tag: str = "mha_lab"
    retries: int = 4
    backoff: float = 1.0
    timeout: float = 30.0


def load(path: Path) -> Registration:
    """The registration in the TOML file ``path``; a missing or unknown key is a ValueError naming it."""
    path = Path(path)
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    missing = [k for k in REQUIRED if not raw.get(k)]
    unknown = sorted(set(raw) - set(Registration.__dataclass_fields__))
    if missing or unknown:
        raise ValueError(f"{path}: " + "; ".join(
            ([f"missing {', '.join(missing)}"] if missing else []) + ([f"unknown {', '.join(unknown)}"] if unknown
                                                                         else [])))
    key = Path(raw["private_key"]).expanduser()
    raw["private_key"] = (key if key.is_absolute() else path.parent / key).read_text()
    return Registration(**raw)


def public_key_set(reg: Registration) -> dict[str, list[dict[str, Any]]]:
    """The tool's public key as a JSON Web Key Set, for the platform's registration of the tool."""
    private = serialization.load_pem_private_key(reg.private_key.encode(), password=None)
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(private.public_key()))
    return {"keys": [{**jwk, "kid": reg.key_id, "alg": "RS256", "use": "sig"}]}


def shown(text: object, limit: int = 300) -> str:
    """``text`` cut to ``limit`` characters, its control and unprintable characters escaped: what the platform
    sent, made safe to print on a terminal."""
    text = str(text)
    cut = text[:limit]
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in cut) + ("..." if len(text) > limit else "")


def origin(url: object, what: str) -> Origin:
    """The (scheme, host, port) of ``url`` as the HTTP transport parses it; LtiError naming ``what`` unless it is a
    plain ``http(s)://host[:port]/...`` URL (no user name, spaces, backslashes or control characters)."""
    if not isinstance(url, str) or not url.isprintable() or " " in url or "\\" in url:
        raise LtiError(f"{what} {shown(url)!r}: not a plain http(s) URL")
    try:
        parts = parse_url(url)
    except (urllib3.exceptions.LocationParseError, ValueError) as exc:
        raise LtiError(f"{what} {shown(url)}: not a URL ({shown(exc, 120)})") from None
    if parts.scheme not in ("http", "https") or not parts.host or parts.auth is not None:
        raise LtiError(f"{what} {shown(url)}: not a plain http(s)://host/... URL")
    return parts.scheme, parts.host.lower(), parts.port or (443 if parts.scheme == "https" else 80)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine: ``localhost``, 127.0.0.0/8 or ``::1``."""
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _shown_origin(o: Origin) -> str:
    return f"{o[0]}://{o[1]}:{o[2]}"


def _read_body(raw: Any, encoding: str, limit: int, deadline: float, what: str) -> bytearray:
    """The body of a reply from ``raw`` (urllib3's stream, read undecoded), inflated as ``encoding`` names, a
    chunk at a time; LtiError as soon as it passes ``limit`` bytes, on the wire or inflated, or ``deadline``."""
    coding = encoding.strip().lower()
    if coding not in WBITS:
        raise LtiError(f"{what}: a reply in the Content-Encoding {shown(encoding, 60)!r}, which is not accepted")
    inflate = zlib.decompressobj(WBITS[coding]) if WBITS[coding] else None
    body, wire = bytearray(), 0
    while chunk := raw.read1(CHUNK, decode_content=False):
        wire += len(chunk)
        if wire > limit:
            raise LtiError(f"{what}: a reply of more than {limit} bytes, refused")
        if time.monotonic() > deadline:
            raise LtiError(f"{what}: the reply took longer than the timeout to arrive, refused")
        if inflate is None:
            body += chunk
            continue
        while True:
            try:
                out = inflate.decompress(chunk, min(CHUNK, limit + 1 - len(body)))  # a chunk at a time
            except zlib.error as exc:
                raise LtiError(f"{what}: a reply that does not inflate as {coding} ({exc})") from None
            body += out
            if len(body) > limit:
                raise LtiError(f"{what}: a reply that inflates past {limit} bytes, refused")
            chunk = inflate.unconsumed_tail
            if inflate.eof and inflate.unused_data:  # gzip allows members one after another
                if coding == "deflate":
                    raise LtiError(f"{what}: bytes after the end of the deflate stream")
                chunk, inflate = inflate.unused_data, zlib.decompressobj(WBITS[coding])
            if not chunk and not out:
                break
    if inflate is not None and not inflate.eof and wire:
        raise LtiError(f"{what}: the compressed reply ends early")
    return body


def _values(body: bytes | bytearray | str) -> int:
    """An upper bound of the values and keys that parsing the JSON ``body`` makes: each but the first opens a
    container or follows a comma or a colon (those inside strings count too)."""
    return 1 + sum(body.count(c) for c in ((b"[", b"{", b",", b":") if isinstance(body, bytes | bytearray)
                                           else ("[", "{", ",", ":")))


def _parse(body: bytes | bytearray | str, what: str) -> Any:
    """``body`` as JSON, refused before parsing when it would make more than ``MAX_VALUES`` objects (a reply
    at the byte limit made of ``{},`` would take 27 times its size in memory); LtiError naming ``what``."""
    if _values(body) > MAX_VALUES:
        raise LtiError(f"{what}: more than {MAX_VALUES} JSON values, refused")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise LtiError(f"{what}: not JSON ({exc.__class__.__name__})") from None


@dataclass(frozen=True)
class Reply:
    """One reply of the platform, its body read within the limits."""

    url: str
    status: int
    reason: str
    headers: Mapping[str, str]
    links: dict
    body: bytearray

    def json(self) -> Any:
        """The body as JSON (``_parse``)."""
        return _parse(self.body, f"the reply of {shown(self.url)}")


def _items(body: Any, key: str) -> list:
    """The list in a container reply: AGS sends a bare array, NRPS ``{"members": [...]}``; some platforms
    page AGS containers as ``{"content": [...], "next": ...}``."""
    if isinstance(body, list):
        return body
    if isinstance(body, dict):
        found = body.get(key, body.get("content"))
        if isinstance(found, list):
            return found
    raise LtiError(f"expected a list of {key} from the platform, got {type(body).__name__}")


def _service(lineitem: str, name: str) -> str:
    """A line item's service endpoint (``scores``, ``results``): ``/name`` appended to its path, its query kept."""
    parts = urlsplit(lineitem)
    return urlunsplit(parts._replace(path=f"{parts.path.rstrip('/')}/{name}"))


class Client:
    """The AGS and NRPS calls of one registration, with a bearer token fetched on first use; a 429 or 5xx is
    tried again ``reg.retries`` times, after ``reg.backoff`` * 2**k seconds (or the reply's Retry-After).

    Every endpoint must be https unless its host is a loopback address or ``allow_http``; the bearer token goes
    only to the origins of ``reg.lineitems_url`` and ``reg.memberships_url``. With ``dry_run`` nothing is sent:
    a request is an LtiError, so a plan that would reach the platform fails loudly."""

    def __init__(self, reg: Registration, log: Callable[[str], None] = print, *, allow_http: bool = False,
                 dry_run: bool = False) -> None:
        self.reg, self.log, self.dry_run = reg, log, dry_run
        origins: dict[str, Origin] = {}
        for key in ENDPOINTS:
            scheme, host, _ = origins[key] = origin(getattr(reg, key), key)
            if scheme != "https" and not (allow_http or is_loopback(host)):
                raise LtiError(f"{key} {shown(getattr(reg, key))}: plain http would carry the token and the scores "
                               "in clear; use https (http is accepted for a loopback host, or with --allow-http)")
        self.origins = {origins["lineitems_url"], origins["memberships_url"]}
        self.session = requests.Session()
        self._token = ""

    def on_platform(self, url: object, what: str) -> str:
        """``url`` when it is on the platform's origin; else LtiError naming it (``what`` says where it came from)."""
        if origin(url, what) not in self.origins:
            raise LtiError(f"refused {what} ({shown(url)}): not on the platform's origin "
                           f"({', '.join(sorted(map(_shown_origin, self.origins)))}); the access token goes nowhere "
                           "else")
        return str(url)

    def assertion(self) -> str:
        """The signed client assertion of a token request (RS256, the tool's key)."""
        now = int(time.time())
        claims = {"iss": self.reg.client_id, "sub": self.reg.client_id, "aud": self.reg.audience or self.reg.token_url,
                  "iat": now, "exp": now + 300, "jti": uuid.uuid4().hex,
                  "https://purl.imsglobal.org/spec/lti/claim/deployment_id": self.reg.deployment_id}
        try:
            return jwt.encode(claims, self.reg.private_key, algorithm="RS256", headers={"kid": self.reg.key_id})
        except (ValueError, TypeError, jwt.PyJWTError) as exc:
            raise LtiError(f"private_key: cannot sign with it ({shown(exc, 120)})") from None

    def token(self) -> str:
        """A bearer token for every scope this tool uses (client credentials, signed assertion)."""
        if not self._token:
            reply = self._send("POST", self.reg.token_url, data={
                "grant_type": "client_credentials",
                "client_assertion_type": "urn:ietf:params:oauth:client-assertion-type:jwt-bearer",
                "client_assertion": self.assertion(), "scope": " ".join(SCOPES)}, auth=False)
            body = reply.json()
            token = body.get("access_token") if isinstance(body, dict) else None
            if not isinstance(token, str) or not token or not token.isprintable():
                raise LtiError(f"{self.reg.token_url} answered without an access_token")
            self._token = token
        return self._token

    def _send(self, method: str, url: str, *, auth: bool = True, accept: str = "", what: str = "the request",
              **kwargs: Any) -> Reply:
        """One request, retried on a 429, a 5xx or no connection; its reply read within the limits. A request
        that carries the token goes to the platform's origin only; a redirect is not followed."""
        if self.dry_run:
            raise LtiError(f"dry run: {method} {shown(url)} would reach the platform")
        if auth:
            self.on_platform(url, what)
        headers = {"Accept-Encoding": "gzip, deflate", **({"Accept": accept} if accept else {}),
                   **kwargs.pop("headers", {})}
        for attempt in range(self.reg.retries + 1):
            if auth:
                headers["Authorization"] = f"Bearer {self.token()}"
            try:
                with self.session.request(method, url, headers=headers, timeout=self.reg.timeout, stream=True,
                                          allow_redirects=False, **kwargs) as r:
                    body = _read_body(r.raw, r.headers.get("Content-Encoding", ""), MAX_BODY,
                                      time.monotonic() + self.reg.timeout, f"{method} {shown(url)}")
                    reply = Reply(url, r.status_code, shown(r.reason, 80), r.headers, r.links, body)
                status, why = reply.status, reply.reason
            except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:  # body cut short too
                reply, status, why = None, 0, f"no connection ({exc.__class__.__name__})"
            if reply is not None and 300 <= status < 400:
                raise LtiError(f"{method} {shown(url)}: redirected ({status}) to "
                               f"{shown(reply.headers.get('Location', '?'))}; not followed: configure the URL itself")
            if reply is not None and status < 400:
                return reply
            if status not in (0, 429) and status < 500 or attempt == self.reg.retries:
                detail = shown(reply.body.decode(errors="replace")) if reply is not None else ""
                raise LtiError(f"{method} {shown(url)}: " + " ".join(str(x) for x in (status, why, detail) if x))
            wait = self.reg.backoff * 2 ** attempt
            if reply is not None and reply.headers.get("Retry-After", "").isdigit():
                wait = min(float(reply.headers["Retry-After"]), 60.0)
            self.log(f"  {method} {shown(url)}: {status or why}, again in {wait:g} s")
            time.sleep(wait)
        raise AssertionError("unreachable")

    def _pages(self, url: str, accept: str, key: str, params: dict | None = None) -> Iterator[Any]:
        """The items of a paged listing, following each page's next link on the platform's origin only; every
        page together within ``MAX_LISTING`` bytes and ``MAX_VALUES`` JSON values."""
        first, spent, values = url, 0, 0
        for _ in range(MAX_PAGES):
            reply = self._send("GET", url, accept=accept, params=params, what=f"the next link of {first}")
            body = reply.json()
            spent, values = spent + len(reply.body), values + _values(reply.body)
            if spent > MAX_LISTING or values > MAX_VALUES:
                raise LtiError(f"the pages of {first} hold more than {MAX_LISTING} bytes or {MAX_VALUES} JSON values "
                               "together, refused")
            yield from _items(body, key)
            following = reply.links.get("next", {}).get("url") or (body.get("next") if isinstance(body, dict) else None)
            if not following:
                return
            if not isinstance(following, str):
                raise LtiError(f"{first}: a next link that is not a URL ({type(following).__name__})")
            url = self.on_platform(urljoin(url, following), f"the next link of {first}")
            params = None  # the next link carries its own query
        raise LtiError(f"more than {MAX_PAGES} pages at {first}")

    def members(self) -> list[dict]:
        """Every member of the context (NRPS), all pages; of each, only what the matching reads."""
        keep = (*MEMBER_FIELDS, self.reg.match)
        return [{k: m[k] for k in keep if k in m} if isinstance(m, dict) else m
                for m in self._pages(self.reg.memberships_url, MEMBERS, "members")]

    def lineitems(self, resource_id: str) -> list[dict]:
        """The context's line items whose resourceId is ``resource_id`` and tag is this tool's."""
        found = self._pages(self.reg.lineitems_url, LINEITEMS, "lineitems",
                            {"resource_id": resource_id, "tag": self.reg.tag})
        return [i for i in found if isinstance(i, dict) and i.get("resourceId") == resource_id
                and i.get("tag") == self.reg.tag]

    def create_lineitem(self, resource_id: str, label: str, maximum: float) -> dict:
        body = {"scoreMaximum": maximum, "label": label, "resourceId": resource_id, "tag": self.reg.tag}
        reply = self._send("POST", self.reg.lineitems_url, accept=LINEITEM, json=body,
                           headers={"Content-Type": LINEITEM}).json()
        if not isinstance(reply, dict):
            raise LtiError(f"{self.reg.lineitems_url}: the created line item is a {type(reply).__name__}")
        return reply

    def post_score(self, lineitem: str, score: dict) -> None:
        self._send("POST", _service(lineitem, "scores"), json=score, headers={"Content-Type": SCORE},
                   what="a line item's scores URL")

    def results(self, lineitem: str) -> list[dict]:
        """The platform's results of one line item (what it recorded of the scores)."""
        return list(self._pages(_service(lineitem, "results"), RESULTS, "results"))


@dataclass
class Outcome:
    """What a run did, or would do in a dry run; ``failed`` holds (student, assignment, reason)."""

    posted: list[tuple[str, str, float | None]] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)
    failed: list[tuple[str, str, str]] = field(default_factory=list)
    unmatched_students: list[str] = field(default_factory=list)
    unmatched_members: list[str] = field(default_factory=list)


def _is_learner(member: dict) -> bool:
    roles = member.get("roles", [])
    return (member.get("status", "Active") == "Active" and isinstance(roles, list)
            and any(str(r).rsplit("#", 1)[-1].rsplit("/", 1)[-1] == "Learner" for r in roles))


def roster(members: Iterable[Any], field_name: str) -> tuple[dict[str, str], list[str]]:
    """nbgrader id -> LTI user id for the active learners, matched on ``field_name``; and the learners that
    match no one (no such field, or a value two members share, named by user id; a member with no user id is
    named by its place in the roster)."""
    by_value: dict[str, list[str]] = {}
    broken = []
    for n, m in enumerate(members):
        if not isinstance(m, dict) or not isinstance(m.get("user_id"), str) or not m["user_id"]:
            broken.append(f"member #{n} (no user_id)")
        elif _is_learner(m):
            by_value.setdefault(str(m.get(field_name, "")).strip(), []).append(m["user_id"])
    matched = {v: ids[0] for v, ids in by_value.items() if v and len(ids) == 1}
    unmatched = sorted(shown(u, 80) for v, ids in by_value.items() if not v or len(ids) > 1 for u in ids)
    return matched, unmatched + broken


def read_roster(path: Path, match: str = "lis_person_sourcedid") -> list[dict]:
    """The members in a roster file, for a dry run: the NRPS membership container as JSON (``{"members":
    [...]}`` or the bare list), or a ``.csv`` whose header names ``user_id``, ``match`` and optionally ``roles``
    (space-separated, default Learner) and ``status`` (default Active). ValueError naming what is wrong."""
    path = Path(path)
    if path.stat().st_size > MAX_LISTING:
        raise ValueError(f"{path}: a roster of more than {MAX_LISTING} bytes")
    try:
        text = path.read_text(encoding="utf-8-sig")
        if path.suffix.lower() == ".csv":
            rows = csv.DictReader(io.StringIO(text, newline=""))
            missing = [c for c in ("user_id", match) if c not in (rows.fieldnames or [])]
            if missing:
                raise ValueError(f"no column {', '.join(missing)} in its header")
            return [{**row, "roles": (row.get("roles") or "Learner").split(), "status": row.get("status") or "Active"}
                    for row in rows]
        return _items(_parse(text, "its JSON"), "members")
    except (ValueError, LtiError, csv.Error) as exc:
        raise ValueError(f"roster {path}: {shown(exc, 200)}") from None


def _stamp() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _lineitem(client: Client, assignment: str, maximum: float, out: Outcome) -> str:
    """The URL of ``assignment``'s line item, found by resourceId and tag, or created; on the platform's origin."""
    found = client.lineitems(assignment)
    if len(found) > 1:
        raise LtiError(f"{len(found)} line items of {assignment} carry the tag {client.reg.tag!r}: remove the extra "
                       "ones")
    if found:
        item = found[0]
    else:
        item = client.create_lineitem(assignment, assignment, maximum)
        out.created.append(assignment)
        client.log(f"created the line item of {assignment}")
    return client.on_platform(item.get("id"), f"the line item URL of {assignment}")


def post_grades(client: Client, grades: dict[tuple[str, str], Grade], assignments: Iterable[str], *,
                members: list[dict] | None = None) -> Outcome:
    """Post the final scores of ``assignments`` (from ``lms.read_grades``) through ``client``, saying each step
    through ``client.log`` as it is done; a failure of one score is recorded and the rest go on. With
    ``client.dry_run`` nothing is sent and the steps are said as they would be done, matched against
    ``members`` (``read_roster``) when given, else against the platform's roster when it is read."""
    reg, out, say, dry = client.reg, Outcome(), client.log, client.dry_run
    todo = {a: {s: g for (s, name), g in grades.items() if name == a} for a in assignments}
    for a, mine in todo.items():
        if not mine:
            raise ValueError(f"no grades for {a}: grade it first, or check its name")
    if dry:
        client.assertion()  # the key signs, or the plan stops here
        say(f"would request a token from {reg.token_url} (client {reg.client_id}, key {reg.key_id})")
    if members is None and dry:
        say(f"would read the roster from {reg.memberships_url}, every page, and match each learner's {reg.match} "
            "to a student id")
        users = None
    else:
        users, out.unmatched_members = roster(client.members() if members is None else members, reg.match)
        graded = {s for (s, _), g in grades.items() if g.status == "graded"}
        out.unmatched_students = sorted(s for s in graded if s not in users)
    for a, mine in todo.items():
        maximum = max(g.max_score for g in mine.values())
        if dry:
            say(f"would find the line item of {a} (resourceId {a}, tag {reg.tag}) at {reg.lineitems_url}, "
                f"or create it with scoreMaximum {maximum:g}")
            lineitem = ""
        else:
            lineitem = _lineitem(client, a, maximum, out)
        for student, grade in sorted(mine.items()):
            if users is not None and student not in users:
                continue
            to = users[student] if users is not None else f"the learner whose {reg.match} is {student}"
            score = {"userId": to, "scoreMaximum": grade.max_score, "timestamp": _stamp(),
                     "activityProgress": "Completed", "gradingProgress": "FullyGraded"}
            if grade.status == "graded" and grade.score is not None:
                score["scoreGiven"] = grade.score
            elif reg.pending and grade.status == "not graded":
                score.update(activityProgress="Submitted", gradingProgress="Pending")
            else:
                out.skipped.append((student, a, grade.status))
                say(f"{'would post' if dry else 'posted'} nothing for {a} {student}: {grade.status}")
                continue
            value = "Pending" if "scoreGiven" not in score else f"{score['scoreGiven']:g}"
            if not dry:
                try:
                    client.post_score(lineitem, score)
                except LtiError as exc:
                    out.failed.append((student, a, str(exc)))
                    continue
            out.posted.append((student, a, score.get("scoreGiven")))
            say(f"would post {a} {student}: {value} (to {shown(to, 80)})" if dry else f"posted {a} {student}: {value}")
    return out
