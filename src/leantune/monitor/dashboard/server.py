"""`leantune dashboard`: the run list and live run pages, and the JSON they poll.

    GET /                                  the run list (static/index.html)
    GET /run/<name>                        one run's page (static/run.html)
    GET /static/<file>                     the page's own scripts and style, no CDN
    GET /api/runs                          every run: name, method, model, steps, status
    GET /api/runs/<name>                   one run: the same, its config, summary, checkpoints
    GET /api/runs/<name>/metrics?after=N&sig=S   metrics.jsonl rows after step N
    GET /api/runs/<name>/eval?after=N&sig=S      eval.jsonl rows after step N
    GET /api/runs/<name>/events?after=K          events.jsonl from the K-th event on

`sig` is the checksum of the client's row at step N (each answer gives the last row's): when
that row is no longer in the file (a resume or rollback rewrote it), the answer holds every row
and `"reset": true`. Only GET and HEAD are served (anything else: 405). Nothing outside the
runs folder is served. Requests must name this machine in their Host header (`monitor.hosts`).
One run's damaged files show in its own row (`RunsFolder.overview`); a request that fails in
another way is a 500 with one log line per distinct error.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from leantune.core.signals import StopSignals
from leantune.layout import RunPaths
from leantune.monitor.dashboard.runs import Log, RunsFolder
from leantune.monitor.dashboard.series import line_sig
from leantune.monitor.hosts import REFUSED, HostCheck

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
# The pages load only their own files: a run's text (config, messages) shown in them can
# never run as a script, load something from elsewhere, or be framed by another site.
SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
SERIES = {"metrics": RunPaths.metrics, "eval": RunPaths.eval}
PAGES = {"/": "index.html"}


class BadRequest(ValueError):
    """A query parameter that is not what the endpoint takes."""


def load_static() -> dict[str, tuple[bytes, str]]:
    """The dashboard's files (name -> content, type), read once from the installed package."""
    # Read once, into memory: a request's path then only ever picks a key of this dict,
    # never a file on disk.
    folder = resources.files("leantune.monitor.dashboard") / "static"
    out = {}
    for entry in folder.iterdir():
        kind = CONTENT_TYPES.get(Path(entry.name).suffix)
        if kind is not None and entry.is_file():
            out[entry.name] = (entry.read_bytes(), kind)
    return out


class DashboardServer(ThreadingHTTPServer):
    """The HTTP server: one thread per request, the runs folder and the static files."""

    # A page's keep-alive connection must not keep the process alive after Ctrl-C.
    daemon_threads = True

    def __init__(self, folder: RunsFolder, host: str, port: int, allow_hosts: Iterable[str] = ()):
        if ":" in host:  # before super().__init__, which creates the socket
            self.address_family = socket.AF_INET6
        self.folder = folder
        self.static = load_static()
        self.hosts = HostCheck.for_bind(host, allow_hosts)
        self._errors: set[str] = set()
        self._errors_lock = threading.Lock()
        super().__init__((host, port), DashboardHandler)

    def log_once(self, message: str) -> None:
        """Log `message` the first time it occurs: a page polls every two seconds."""
        with self._errors_lock:
            # The cap bounds memory when every request fails differently.
            if message in self._errors or len(self._errors) >= 1000:
                return
            self._errors.add(message)
        self.folder.log(message)

    @property
    def url(self) -> str:
        """The address to open in a browser."""
        host, port = str(self.server_address[0]), int(self.server_address[1])
        return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


class DashboardHandler(BaseHTTPRequestHandler):
    """Answers one request: GET/HEAD of a page, a static file or an API endpoint."""

    server: DashboardServer
    server_version = "leantune-dashboard"
    sys_version = ""  # the Server header need not tell the Python version
    protocol_version = "HTTP/1.1"  # keep-alive: each open page polls every two seconds

    def do_GET(self) -> None:
        self._answer(with_body=True)

    def do_HEAD(self) -> None:
        self._answer(with_body=False)

    def _refuse(self) -> None:
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"only GET and HEAD\n", "text/plain", True,
                   {"Allow": "GET, HEAD"})  # fmt: skip

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _refuse

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a poll every two seconds per open page would flood the terminal

    def _answer(self, with_body: bool) -> None:
        # Before any routing: a web page whose domain was re-pointed at this machine (DNS
        # rebinding) must not read the runs, nor learn which paths exist.
        if not self.server.hosts.allows(self.headers.get("Host")):
            self._send(HTTPStatus.FORBIDDEN, REFUSED, "text/plain", with_body)
            return
        try:
            found = self._route()
        except BadRequest as exc:
            self._send(HTTPStatus.BAD_REQUEST, f"{exc}\n".encode(), "text/plain", with_body)
            return
        except OSError:  # a run directory moved or removed while it was read: the next poll
            body = b"the run directory changed while it was read; try again\n"
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, body, "text/plain", with_body)
            return
        except Exception as exc:  # a run's files in a shape nothing expected: that request only
            message = f"dashboard: {self.path.split('?')[0]}: {type(exc).__name__}: {exc}"
            self.server.log_once(message[:500])
            body = f"{message}\n".encode()
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, body, "text/plain", with_body)
            return
        if found is None:
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain", with_body)
            return
        body, kind = found
        self._send(HTTPStatus.OK, body, kind, with_body)

    def _route(self) -> tuple[bytes, str] | None:
        """(body, content type) for the request's path, or None: not found."""
        if not self.path.startswith("/"):
            return None  # an absolute URI ("http://host/...") or "*"
        split = urlsplit(self.path)
        try:
            path = unquote(split.path, errors="strict")
        except UnicodeDecodeError:
            raise BadRequest("the path is not UTF-8") from None
        query = parse_qs(split.query)
        folder, static = self.server.folder, self.server.static
        # Neither ever names a run or a file; refused before they reach a lookup.
        if "\0" in path or "\\" in path:
            return None
        if path in PAGES:
            return static.get(PAGES[path])
        if path.startswith("/static/"):
            return static.get(path.removeprefix("/static/"))
        if path.startswith("/run/"):
            run = folder.find(path.removeprefix("/run/"))
            return static.get("run.html") if run is not None else None
        if path == "/api/runs":
            runs = [folder.overview(r) for r in folder.runs()]
            return _json({"root": str(folder.root), "time": time.time(), "runs": runs})
        if path.startswith("/api/runs/"):
            return self._run_api(path.removeprefix("/api/runs/"), query)
        return None

    def _run_api(self, rest: str, query: dict[str, list[str]]) -> tuple[bytes, str] | None:
        folder = self.server.folder
        # "a/b" is either the grouped run a/b or run a's endpoint b: a run by that name wins.
        run = folder.find(rest)
        if run is not None:
            return _json(folder.detail(run))
        name, _, endpoint = rest.rpartition("/")
        run = folder.find(name)
        if run is None:
            return None
        if endpoint in SERIES:
            rows = folder.jsonl(run, SERIES[endpoint])
            after = _int_param(query, "after")
            lines, reset = rows.after_step(after, _param(query, "sig"))
            last = {"step": rows.steps[-1], "sig": line_sig(rows.lines[-1])} if rows.lines else None
            # The rows are JSON texts already: spliced in, not parsed and serialised again.
            # [:-1] drops the closing brace, which the splice puts back after the rows.
            head = json.dumps({"reset": reset, "last": last})[:-1]
            return _raw_json(f'{head}, "rows": [{", ".join(lines)}]}}')
        if endpoint == "events":
            lines = folder.jsonl(run, RunPaths.events).lines
            after = _int_param(query, "after") or 0
            reset = after > len(lines)  # the file was replaced: a new run in this directory
            new = lines if reset else lines[after:]
            head = json.dumps({"reset": reset, "count": len(lines)})[:-1]
            return _raw_json(f'{head}, "events": [{", ".join(new)}]}}')
        return None

    def _send(
        self,
        status: HTTPStatus,
        body: bytes,
        kind: str,
        with_body: bool,
        extra: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")  # live data: a cached answer is stale
        for key, value in {**SECURITY_HEADERS, **(extra or {})}.items():
            self.send_header(key, value)
        self.end_headers()
        if with_body:
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # the page went away (navigated, closed)


def _json(value: Any) -> tuple[bytes, str]:
    # The browser's JSON.parse refuses NaN: a value that slipped past finite_json fails here,
    # as one logged 500, rather than as a page that silently stops updating.
    return _raw_json(json.dumps(value, allow_nan=False))


def _raw_json(text: str) -> tuple[bytes, str]:
    return text.encode("utf-8"), "application/json; charset=utf-8"


def _param(query: dict[str, list[str]], key: str) -> str | None:
    values = query.get(key)
    return values[-1] if values else None


def _int_param(query: dict[str, list[str]], key: str) -> int | None:
    value = _param(query, key)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise BadRequest(f"{key} must be an integer") from None


def make_server(
    root: Path,
    host: str = "127.0.0.1",
    port: int = 0,
    allow_hosts: Iterable[str] = (),
    log: Log | None = None,
) -> DashboardServer:
    """A dashboard server for the runs under `root`, bound but not yet serving.

    Args:
        root: The runs folder.
        host: The address to bind.
        port: The port (0: any free one).
        allow_hosts: Host names requests may name besides this machine's own (`monitor.hosts`).
        log: Where problems found in runs go, one line each (default: stderr).

    Raises:
        OSError: the address cannot be bound (the port is in use, the host is not local).
    """
    return DashboardServer(RunsFolder(root, log or _stderr), host, port, allow_hosts)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def serve(server: DashboardServer, log: Callable[[str], None] = print) -> None:
    """Serve until Ctrl-C (SIGINT) or SIGTERM, then close the socket and re-raise.

    Both signals get `train`'s handler (`StopSignals`) while it serves. Off the main thread (a
    test's server) signals are left as they are.

    Raises:
        Interrupted: SIGINT or SIGTERM arrived; the command exits 130 / 143 (`exit_code`).
    """
    try:
        # Installed whatever the process inherited: a dashboard started by `nohup` or a
        # script's `&` starts with SIGINT ignored, and `docker stop` or systemd send SIGTERM.
        with StopSignals():
            # Said only once the handlers are in: whoever waits for this line may signal at once.
            log(f"dashboard: {server.url} (runs in {server.folder.root}); Ctrl-C stops it")
            server.serve_forever(poll_interval=0.5)
    finally:
        server.server_close()
