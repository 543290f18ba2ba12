"""The HTTP endpoint of a run's metrics: /metrics (Prometheus text format) and /health.

A small threaded WSGI server on a daemon thread; `stop()` shuts it down and frees the port. A
request whose Host header names another server is refused (403, `hosts`).
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from leantune.errors import UserError
from leantune.monitor.hosts import REFUSED, HostCheck

Health = Callable[[], dict[str, Any]]
StartResponse = Callable[..., Any]


class MetricsPortInUse(UserError):
    """The configured metrics port cannot be bound (exit 2, before training starts)."""


# Threaded on a daemon thread, so a scrape never waits on the training step, and a request
# still open cannot keep the process alive once training ends.
class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):  # the socketserver classes are IPv4 unless told otherwise
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape would drown the run's own log


def check_port(host: str, port: int) -> None:
    """Raise `MetricsPortInUse` when `host:port` cannot be bound now (port 0 always can)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # As the server binds (wsgiref sets SO_REUSEADDR): a port a previous run just closed
        # is free, one another process listens on is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise _in_use(host, port, e) from None


def _in_use(host: str, port: int, error: OSError) -> MetricsPortInUse:
    return MetricsPortInUse(
        f"monitor.metrics_port={port}: cannot serve metrics on {host}:{port} "
        f"({error.strerror or error}); another process (an earlier run?) holds it. Give another "
        "port (--metrics-port N or monitor.metrics_port=N; 0 picks a free one) or stop that "
        "process"
    )


def wsgi_app(
    registry: CollectorRegistry, health: Health, lock: threading.Lock, hosts: HostCheck
) -> Callable[..., Iterable[bytes]]:
    """/metrics: the registry in the text format; /health: `health()` as JSON; else 404; 403
    for a Host header that `hosts` does not allow."""

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        # Checked first, for every path: a web page re-pointed at this machine (DNS rebinding)
        # must not read the run's name and model, nor learn which paths exist.
        if not hosts.allows(environ.get("HTTP_HOST")):
            body, kind, status = REFUSED, "text/plain", "403 Forbidden"
        elif path == "/metrics":
            # The sink holds the lock while it writes one record's values: a scrape sees all of
            # one step or all of the next, never a step's number with the previous step's loss.
            with lock:
                body = generate_latest(registry)
            kind, status = CONTENT_TYPE_LATEST, "200 OK"
        elif path == "/health":
            with lock:
                body = json.dumps(health()).encode()
            kind, status = "application/json", "200 OK"
        else:
            body, kind, status = (
                b"not found: try /metrics or /health\n",
                "text/plain",
                "404 Not Found",
            )
        start_response(status, [("Content-Type", kind), ("Content-Length", str(len(body)))])
        return [body]

    return app


class MetricsServer:
    """Serves a registry on `host:port` from a daemon thread until `stop()`, to requests whose
    Host header names this machine or one of `allowed_hosts`."""

    def __init__(
        self,
        registry: CollectorRegistry,
        health: Health,
        lock: threading.Lock,
        host: str,
        port: int,
        allowed_hosts: Iterable[str] = (),
    ):
        server_class = _Server6 if ":" in host else _Server
        app = wsgi_app(registry, health, lock, HostCheck.for_bind(host, allowed_hosts))
        try:
            self._server = make_server(host, port, app, server_class, _QuietHandler)
        except OSError as e:
            raise _in_use(host, port, e) from None
        self.host = host
        self.port = int(self._server.server_address[1])
        """The bound port (the one picked when `port` was 0)."""
        # shutdown() waits up to one poll interval: 0.1 s, not the default 0.5, keeps stop() quick.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        """http://host:port (brackets around an IPv6 address)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        # Closing the socket lets the next run in this process bind the same port at once.
        self._server.server_close()
        self._thread.join()
