"""A Hugging Face Hub model repo read in place: ``hf://ORG/NAME[@REVISION][/PATH]``.

Read-only. The revision (default ``main``) is resolved once to its commit (``sha`` of
``{endpoint}/api/models/{repo}/revision/{revision}``, whose ``siblings`` are the listing) and
every file is then read at that commit (``{endpoint}/{repo}/resolve/{sha}/{path}``), so a push
while a restore reads cannot mix two revisions. Tensor bytes are fetched by TensorStore's
``http`` kvstore with ``Range`` requests; it follows no redirect, so the Hub's hop to its CDN is
followed here once per file (``ranged``): relative hops on the Hub itself, up to the first one
to another host or scheme (http or https only), which is fetched without the token, as
``huggingface_hub`` does (never over http from an https endpoint). Endpoint from
``HF_ENDPOINT`` (default https://huggingface.co), token from ``HF_TOKEN``.
Everything the Hub sends is bounded (the listing, any file read whole), in bytes and in time
(``DEADLINE_S`` per request in all, ``JAX_UCP_HUB_DEADLINE_S`` to change it: a server that
trickles a byte every few seconds never meets the per-read ``TIMEOUT_S``), and so are the
retries of a server that keeps failing (``RETRIES``: ~50 s, where TensorStore's own wait ~15 min).
"""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import NoReturn

from jax_ucp._src import format as fmt
from jax_ucp._src.errors import RequestError, SourceError
from jax_ucp._src.store.storage.base import Storage, held

SCHEME = "hf://"
MAX_LISTING_BYTES = 16 << 20  # the repo's file list (the Hub's JSON for a large repo: ~1 MB)
MAX_REDIRECTS = 5
TIMEOUT_S = 60  # per read of the socket
DEADLINE_S = 300.0  # per request, in all (``deadline_s``)
DEADLINE_ENV = "JAX_UCP_HUB_DEADLINE_S"
RETRIES = {"max_retries": 8, "initial_delay": "1s", "max_delay": "8s"}  # TensorStore's reads
READ_ONLY = "a Hub repo is read-only: convert it to a local or s3:// destination"
_SHA = re.compile(r"[0-9a-f]{40}\Z")
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # a 3xx is answered as an HTTPError: followed by ``_open``


_OPENER = urllib.request.build_opener(_NoRedirect)


class HubDeadlineError(SourceError):
    """A request to the Hub took longer in all than its deadline (``deadline_s``)."""


def deadline_s() -> float:
    """The most seconds one request to the Hub may take (``JAX_UCP_HUB_DEADLINE_S``, else
    ``DEADLINE_S``)."""
    text = os.environ.get(DEADLINE_ENV, "")
    try:
        value = float(text) if text else DEADLINE_S
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise RequestError(f"{DEADLINE_ENV}={text!r}: expected a positive number of seconds")
    return value


def _read(response, limit: int, url: str, started: float) -> bytes:
    """At most ``limit + 1`` bytes of ``response``, refused past the request's deadline."""
    end, out = started + deadline_s(), bytearray()
    while len(out) <= limit:
        chunk = response.read1(min(1 << 20, limit + 1 - len(out)))
        if not chunk:
            break
        out += chunk
        if time.monotonic() > end:
            raise HubDeadlineError(
                f"{url}: {len(out)} bytes in {time.monotonic() - started:.0f} s, past the "
                f"{deadline_s():g} s a request may take in all ({DEADLINE_ENV}); the server "
                f"is too slow or trickling its answer"
            )
    return bytes(out)


def _endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def auth_headers(url: str) -> dict[str, str]:
    """The token, for the endpoint's own scheme and host only (never for the CDN a file
    redirects to, nor over http where the endpoint is https)."""
    token = os.environ.get("HF_TOKEN")
    same = _origin(url) == _origin(_endpoint())
    return {"Authorization": f"Bearer {token}"} if token and same else {}


def _origin(url: str) -> tuple[str, str]:
    return urllib.parse.urlsplit(url)[:2]


def _open(url: str, method: str = "GET", *, follow_off_host: bool = True):
    """(final URL, response or None for a 404) of ``url``, redirects followed here: only to
    http(s), at most ``MAX_REDIRECTS``; ``follow_off_host`` False stops at the first hop to
    another host and returns (that URL, None) without requesting it."""
    host = _origin(_endpoint())
    for _ in range(MAX_REDIRECTS + 1):
        if not follow_off_host and _origin(url) != host:
            return url, None
        request = urllib.request.Request(url, method=method, headers=auth_headers(url))
        try:
            return url, _OPENER.open(request, timeout=min(TIMEOUT_S, deadline_s()))
        except urllib.error.HTTPError as e:
            e.close()
            if e.code == 404:
                return url, None
            if e.code not in (301, 302, 303, 307, 308) or not e.headers.get("Location"):
                why = str(e.headers.get("X-Error-Message") or e.reason)[:200]
                hint = "; HF_TOKEN must give access" if e.code in (401, 403) else ""
                raise SourceError(f"{url}: HTTP {e.code} ({why}){hint}") from None
            url = urllib.parse.urljoin(url, e.headers["Location"])
            if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
                raise SourceError(
                    f"redirected to {url[:200]!r}: only http(s) is followed"
                ) from None
        except (urllib.error.URLError, OSError) as e:
            raise SourceError(f"{url}: {e}") from None
    raise SourceError(f"{url}: more than {MAX_REDIRECTS} redirects")


def parse(url: str) -> tuple[str, str, str]:
    """(repo, revision, path in the repo) of ``hf://ORG/NAME[@REVISION][/PATH]``."""
    if not url.startswith(SCHEME):
        raise RequestError(f"{url}: not a Hub URL (expected {SCHEME}ORG/NAME[@REVISION])")
    org, _, rest = url[len(SCHEME) :].rstrip("/").partition("/")
    name, _, path = rest.partition("/")
    name, _, revision = name.partition("@")
    parts = path.split("/") if path else []
    if not (_PART.match(org) and _PART.match(name)) or not _PART.match(revision or "main"):
        raise RequestError(
            f"{url}: expected {SCHEME}ORG/NAME[@REVISION][/PATH] (letters, digits, '.', '_', '-')"
        )
    if any(p in ("", ".", "..") for p in parts):
        raise RequestError(f"{url}: empty, '.' or '..' path components are not allowed")
    return f"{org}/{name}", revision or "main", path


class HubRepo(Storage):
    """A Hub model repo (or a folder of it) at one commit: listed by the Hub's API, its files
    read by ranged GETs. Nothing is written."""

    no_manifest_hint = " (a Hub repo of safetensors is restored or converted as such)"

    def __init__(self, root: str):
        super().__init__(root)
        self.repo, self.revision, self.path = parse(root)
        self._pinned: tuple[str, list[str]] | None = None
        self._lock = threading.Lock()  # one listing, whichever thread asks first
        self._ranged: dict[str, tuple[dict, str]] = {}

    def _listing(self) -> tuple[str, list[str]]:
        """(commit sha, every file of the repo at it), asked of the Hub once."""
        with self._lock:
            return self._pinned or self._list()

    def _list(self) -> tuple[str, list[str]]:
        """The model info's ``sha`` and ``siblings`` (bounded, checked)."""
        quoted = urllib.parse.quote(self.revision, safe="")
        api = f"{_endpoint()}/api/models/{self.repo}/revision/{quoted}"
        started = time.monotonic()
        _, response = _open(api)
        if response is None:
            raise SourceError(
                f"{self.root}: no model repo {self.repo!r} with a revision "
                f"{self.revision!r} on {_endpoint()} (HTTP 404; a private or gated repo "
                f"needs HF_TOKEN)"
            )
        with response:
            raw = _read(response, MAX_LISTING_BYTES, api, started)
        if len(raw) > MAX_LISTING_BYTES:
            raise SourceError(f"{api}: more than {MAX_LISTING_BYTES} bytes of listing")
        try:
            info = fmt.files.strict_loads(raw)
            sha, siblings = info["sha"], [s["rfilename"] for s in info["siblings"]]
        except (ValueError, RecursionError, KeyError, TypeError) as e:
            raise SourceError(f"{api}: not the Hub's model info ({str(e)[:200]})") from None
        if not isinstance(sha, str) or not _SHA.match(sha):
            raise SourceError(f"{api}: 'sha' is {str(sha)[:60]!r}, not a commit")
        self._pinned = sha, [n for n in siblings if isinstance(n, str)]
        return self._pinned

    @property
    def sha(self) -> str:
        """The commit every file is read at."""
        return self._listing()[0]

    def _url(self, name: str) -> str:
        full = held(f"{self.root}/{name}", "/".join(p for p in (self.path, name) if p))
        return f"{_endpoint()}/{self.repo}/resolve/{self.sha}/{urllib.parse.quote(full)}"

    def absolute(self) -> str:
        """The URL pinned to its commit: ``hf://ORG/NAME@SHA[/PATH]``."""
        return self.join()

    def join(self, *parts: str) -> str:
        tail = "/".join(p.strip("/") for p in (self.path, *parts) if p)
        return f"{SCHEME}{self.repo}@{self.sha}" + (f"/{tail}" if tail else "")

    def kvstore(self, *subpath: str) -> dict:
        """The ``http`` kvstore of the files at the commit (a redirected file: ``ranged``)."""
        tail = "/".join(p.strip("/") for p in (self.path, *subpath) if p)
        folder = urllib.parse.quote(tail + "/") if tail else ""  # the repo's root: no '//'
        base = f"{_endpoint()}/{self.repo}/resolve/{self.sha}/{folder}"
        return _kvstore(base)

    def ranged(self, name: str) -> tuple[dict, str]:
        """A kvstore spec and key that file ``name`` is read from by ``Range`` requests: the
        Hub's redirect to its CDN followed once per file, here."""
        if name not in self._ranged:
            url, response = _open(self._url(name), "HEAD", follow_off_host=False)
            if response is not None:
                response.close()
            self._ranged[name] = _kvstore(url), ""
        return self._ranged[name]

    def read(self, name: str, limit: int) -> bytes | None:
        if not self.exists(name):
            return None
        started = time.monotonic()
        url, response = _open(self._url(name))
        if response is None:
            raise SourceError(f"{url}: listed at {self.sha} but not found (HTTP 404)")
        with response:
            size = response.headers.get("Content-Length", "")
            if size.isascii() and size.isdigit() and int(size) > limit:  # refused unread
                raise RequestError(
                    f"{self.join(name)}: {int(size)} bytes, more than the {limit} it may have"
                )
            data = _read(response, limit, url, started)
        if len(data) > limit:
            raise RequestError(f"{self.join(name)}: more than the {limit} bytes it may have")
        return data

    def exists(self, name: str) -> bool:
        return "/".join(p for p in (self.path, name) if p) in self._listing()[1]

    def folder(self, name: str, *, link: bool = True) -> HubRepo:
        """Folder ``name`` of this repo at the commit already listed (no second listing)."""
        inner = HubRepo(self.join(name))
        inner._pinned = self._pinned
        return inner

    def names(self, prefix: str = "") -> list[str]:
        """Every file of the repo under ``PATH`` (nested ones too) starting with ``prefix``."""
        under = f"{self.path}/" if self.path else ""
        full = under + prefix
        listed = (n[len(under) :] for n in self._listing()[1] if n.startswith(full))
        return sorted(n if n.endswith("/") else held(self.join(n), n) for n in listed)

    def identity(self) -> str:
        return self.sha

    def write(self, *args, **kwargs) -> NoReturn:
        raise RequestError(f"{self.root}: {READ_ONLY}")

    write_manifest = delete = lock = refuse_early = transaction = write


def _kvstore(url: str) -> dict:
    """TensorStore's ``http`` kvstore of ``url``, its retries of a failing server bounded
    (~50 s: TensorStore's own 32 retries up to 32 s apart wait ~15 min on a Hub answering 5xx)."""
    headers = [f"{k}: {v}" for k, v in auth_headers(url).items()]
    context = {"http_request_retries": RETRIES}
    return {"driver": "http", "base_url": url, "headers": headers, "context": context}
