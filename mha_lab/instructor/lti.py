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
    timeout = 30.0                        # seconds per request

The platform needs the tool's public key: ``python -m mha_lab export --lti-jwks CONFIG`` prints it as a key set.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import jwt
import requests
import tomllib
from cryptography.hazmat.primitives import serialization

from mha_lab.instructor.lms import Grade

__all__ = ["Registration", "LtiError", "Outcome", "load", "public_key_set", "Client", "post_grades"]

SCOPES = ("https://purl.imsglobal.org/spec/lti-ags/scope/lineitem",
          "https://purl.imsglobal.org/spec/lti-ags/scope/result.readonly",
          "https://purl.imsglobal.org/spec/lti-ags/scope/score",
          "https://purl.imsglobal.org/spec/lti-nrps/scope/contextmembership.readonly")
LINEITEM = "application/vnd.ims.lis.v2.lineitem+json"
LINEITEMS = "application/vnd.ims.lis.v2.lineitemcontainer+json"
SCORE = "application/vnd.ims.lis.v1.score+json"
RESULTS = "application/vnd.ims.lis.v2.resultcontainer+json"
MEMBERS = "application/vnd.ims.lti-nrps.v2.membershipcontainer+json"
MAX_BODY = 16 << 20  # bytes of one reply from the platform
MAX_PAGES = 1000
REQUIRED = ("client_id", "deployment_id", "token_url", "private_key", "key_id", "lineitems_url", "memberships_url")


class LtiError(RuntimeError):
    """The platform refused or failed a request; the message names it."""


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


def _items(body: Any, key: str) -> list[dict]:
    """The list in a container reply: AGS sends a bare array, NRPS ``{"members": [...]}``; some platforms
    page AGS containers as ``{"content": [...], "next": ...}``."""
    if isinstance(body, list):
        return body
    if isinstance(body, dict):
        found = body.get(key, body.get("content"))
        if isinstance(found, list):
            return found
    raise LtiError(f"expected a list of {key} from the platform, got {type(body).__name__}")


class Client:
    """The AGS and NRPS calls of one registration, with a bearer token fetched on first use; a 429 or 5xx is
    tried again ``reg.retries`` times, after ``reg.backoff`` * 2**k seconds (or the reply's Retry-After)."""

    def __init__(self, reg: Registration, log: Callable[[str], None] = print) -> None:
        self.reg, self.log = reg, log
        self.session = requests.Session()
        self._token = ""

    def _assertion(self) -> str:
        now = int(time.time())
        claims = {"iss": self.reg.client_id, "sub": self.reg.client_id, "aud": self.reg.audience or self.reg.token_url,
                  "iat": now, "exp": now + 300, "jti": uuid.uuid4().hex,
                  "https://purl.imsglobal.org/spec/lti/claim/deployment_id": self.reg.deployment_id}
        return jwt.encode(claims, self.reg.private_key, algorithm="RS256", headers={"kid": self.reg.key_id})

    def token(self) -> str:
        """A bearer token for every scope this tool uses (client credentials, signed assertion)."""
        if not self._token:
            reply = self._send("POST", self.reg.token_url, data={
                "grant_type": "client_credentials",
                "client_assertion_type": "urn:ietf:params:oauth:client-assertion-type:jwt-bearer",
                "client_assertion": self._assertion(), "scope": " ".join(SCOPES)}, auth=False)
            token = reply.json().get("access_token") if reply.content else None
            if not isinstance(token, str) or not token:
                raise LtiError(f"{self.reg.token_url} answered without an access_token")
            self._token = token
        return self._token

    def _send(self, method: str, url: str, *, auth: bool = True, accept: str = "", **kwargs: Any
              ) -> requests.Response:
        headers = {**({"Accept": accept} if accept else {}), **kwargs.pop("headers", {})}
        for attempt in range(self.reg.retries + 1):
            if auth:
                headers["Authorization"] = f"Bearer {self.token()}"
            try:
                reply = self.session.request(method, url, headers=headers, timeout=self.reg.timeout, **kwargs)
                status, why = reply.status_code, reply.reason
            except requests.ConnectionError as exc:
                reply, status, why = None, 0, f"no connection ({exc.__class__.__name__})"
            if reply is not None and len(reply.content) > MAX_BODY:
                raise LtiError(f"{method} {url}: reply of {len(reply.content)} bytes, above {MAX_BODY}")
            if reply is not None and status < 400:
                return reply
            if status not in (0, 429) and status < 500 or attempt == self.reg.retries:
                detail = reply.text[:300] if reply is not None else ""
                raise LtiError(f"{method} {url}: {status or ''} {why} {detail}".strip())
            wait = self.reg.backoff * 2 ** attempt
            if reply is not None and reply.headers.get("Retry-After", "").isdigit():
                wait = min(float(reply.headers["Retry-After"]), 60.0)
            self.log(f"  {method} {url}: {status or why}, again in {wait:g} s")
            time.sleep(wait)
        raise AssertionError("unreachable")

    def _pages(self, url: str, accept: str, key: str, params: dict | None = None) -> Iterator[dict]:
        for _ in range(MAX_PAGES):
            reply = self._send("GET", url, accept=accept, params=params)
            body = reply.json()
            yield from _items(body, key)
            url = reply.links.get("next", {}).get("url") or (body.get("next") if isinstance(body, dict) else None)
            params = None  # the next link carries its own query
            if not url:
                return
        raise LtiError(f"more than {MAX_PAGES} pages at {url}")

    def members(self) -> list[dict]:
        """Every member of the context (NRPS), all pages."""
        return list(self._pages(self.reg.memberships_url, MEMBERS, "members"))

    def lineitems(self, resource_id: str) -> list[dict]:
        """The context's line items whose resourceId is ``resource_id`` and tag is this tool's."""
        found = self._pages(self.reg.lineitems_url, LINEITEMS, "lineitems",
                            {"resource_id": resource_id, "tag": self.reg.tag})
        return [i for i in found if i.get("resourceId") == resource_id and i.get("tag") == self.reg.tag]

    def create_lineitem(self, resource_id: str, label: str, maximum: float) -> dict:
        body = {"scoreMaximum": maximum, "label": label, "resourceId": resource_id, "tag": self.reg.tag}
        return self._send("POST", self.reg.lineitems_url, accept=LINEITEM, json=body,
                          headers={"Content-Type": LINEITEM}).json()

    def post_score(self, lineitem: str, score: dict) -> None:
        self._send("POST", f"{lineitem.rstrip('/')}/scores", json=score, headers={"Content-Type": SCORE})

    def results(self, lineitem: str) -> list[dict]:
        """The platform's results of one line item (what it recorded of the scores)."""
        return list(self._pages(f"{lineitem.rstrip('/')}/results", RESULTS, "results"))


@dataclass
class Outcome:
    """What a run did, or would do with ``dry_run``; ``failed`` holds (student, assignment, reason)."""

    posted: list[tuple[str, str, float | None]] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)
    failed: list[tuple[str, str, str]] = field(default_factory=list)
    unmatched_students: list[str] = field(default_factory=list)
    unmatched_members: list[str] = field(default_factory=list)


def roster(members: Iterable[dict], field_name: str) -> tuple[dict[str, str], list[str]]:
    """nbgrader id -> LTI user id for the active learners, matched on ``field_name``; and the learners that
    match no one (no such field, or a value two members share, named by user id)."""
    learners = [m for m in members if m.get("status", "Active") == "Active"
                and any(str(r).rsplit("#", 1)[-1].rsplit("/", 1)[-1] == "Learner" for r in m.get("roles", []))]
    by_value: dict[str, list[str]] = {}
    for m in learners:
        value = str(m.get(field_name, "")).strip()
        by_value.setdefault(value, []).append(str(m["user_id"]))
    matched = {v: ids[0] for v, ids in by_value.items() if v and len(ids) == 1}
    unmatched = sorted(u for v, ids in by_value.items() if not v or len(ids) > 1 for u in ids)
    return matched, unmatched


def _stamp() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def post_grades(client: Client, grades: dict[tuple[str, str], Grade], assignments: Iterable[str], *,
                dry_run: bool = False) -> Outcome:
    """Post the final scores of ``assignments`` (from ``lms.read_grades``) through ``client``; a failure of one
    score is recorded and the rest go on; nothing is written with ``dry_run``."""
    reg, out = client.reg, Outcome()
    users, out.unmatched_members = roster(client.members(), reg.match)
    students = sorted({s for s, _ in grades})
    out.unmatched_students = [s for s in students if s not in users
                              and any(g.status == "graded" for (who, _), g in grades.items() if who == s)]
    for a in assignments:
        mine = {s: g for (s, name), g in grades.items() if name == a}
        if not mine:
            raise ValueError(f"no grades for {a}: grade it first, or check its name")
        maximum = max(g.max_score for g in mine.values())
        found = client.lineitems(a)
        if len(found) > 1:
            raise LtiError(f"{len(found)} line items of {a} carry the tag {reg.tag!r}: remove the extra ones")
        if found:
            lineitem = found[0]["id"]
        elif dry_run:
            lineitem = ""
            out.created.append(a)
        else:
            lineitem = client.create_lineitem(a, a, maximum)["id"]
            out.created.append(a)
        for student, grade in sorted(mine.items()):
            if student not in users:
                continue
            score = {"userId": users[student], "scoreMaximum": grade.max_score, "timestamp": _stamp(),
                     "activityProgress": "Completed", "gradingProgress": "FullyGraded"}
            if grade.status == "graded" and grade.score is not None:
                score["scoreGiven"] = grade.score
            elif reg.pending and grade.status == "not graded":
                score.update(activityProgress="Submitted", gradingProgress="Pending")
            else:
                out.skipped.append((student, a, grade.status))
                continue
            if not dry_run:
                try:
                    client.post_score(lineitem, score)
                except LtiError as exc:
                    out.failed.append((student, a, str(exc)))
                    continue
            out.posted.append((student, a, score.get("scoreGiven")))
    return out
