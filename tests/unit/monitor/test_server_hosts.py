"""DNS rebinding against the two servers (the dashboard and a run's /metrics): a web page whose
domain is re-pointed at this machine sends its own domain in the Host header; both servers
answer only requests that name this machine, and a bind beyond loopback warns once."""

from __future__ import annotations

import contextlib
import http.client
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from support import run_cli

from leantune.config.parse import ConfigError
from leantune.monitor.dashboard import make_server
from leantune.monitor.prometheus import PrometheusSink, RunFacts
from leantune.training.checks import load_config

SECRET_MODEL = "org/secret-model-7c1e"


def raw_get(port: int, path: str, host: str | None) -> tuple[int, bytes]:
    """GET `path` from 127.0.0.1:`port` with exactly the Host header given (None: none)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("GET", path, skip_host=True)
        if host is not None:
            conn.putheader("Host", host)
        conn.endheaders()
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@contextlib.contextmanager
def dashboard(root: Path, host: str, allow: tuple[str, ...] = ()) -> Iterator[int]:
    server = make_server(root, host, 0, allow_hosts=allow)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextlib.contextmanager
def metrics(tmp_path: Path, host: str, allow: tuple[str, ...] = ()) -> Iterator[tuple[int, str]]:
    lines: list[str] = []
    facts = RunFacts("r", "lora", SECRET_MODEL, "cpu", "fp32", 10, 1, 2)
    sink = PrometheusSink(host, 0, facts, tmp_path / "checkpoints", lines.append, allow)
    sink.start(0)
    try:
        assert sink.server is not None
        yield sink.server.port, "\n".join(lines)
    finally:
        sink.close()


@pytest.fixture()
def runs(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "one"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"path": SECRET_MODEL}}))
    return run.parent


FOREIGN = ("attacker.example:{port}", "attacker.example", "localhost.attacker.example:{port}",
           "127.0.0.1.nip.io:{port}", "", "[::1:{port}", "localhost:{port}:1")  # fmt: skip
"""Hosts a rebinding page (or a malformed request) sends: refused whatever the port."""
OWN = ("127.0.0.1:{port}", "localhost:{port}", "LOCALHOST", "[::1]:{port}", "localhost:9999")
"""Loopback names: accepted on any port (`ssh -L 9999:localhost:PORT` sends localhost:9999)."""


def test_the_dashboard_on_loopback_answers_only_loopback_names(runs: Path) -> None:
    with dashboard(runs, "127.0.0.1") as port:
        for host in FOREIGN:
            status, body = raw_get(port, "/api/runs", host.format(port=port))
            assert status == 403 and SECRET_MODEL.encode() not in body, host
        for host in OWN:
            status, body = raw_get(port, "/api/runs", host.format(port=port))
            assert status == 200 and SECRET_MODEL.split("/")[1].encode() in body, host
        # An address of another interface is no name of a loopback-bound server.
        assert raw_get(port, "/api/runs", f"10.1.2.3:{port}")[0] == 403


def test_the_dashboard_on_all_interfaces_still_refuses_foreign_names(runs: Path) -> None:
    with dashboard(runs, "0.0.0.0", allow=("runs.example.org",)) as port:
        for host in FOREIGN:
            status, body = raw_get(port, "/", host.format(port=port))
            assert status == 403 and b"<html" not in body.lower(), host
            assert raw_get(port, "/api/runs", host.format(port=port))[0] == 403, host
        # This machine's names and addresses (any address: a DNS name is what a rebinding page
        # needs, an IP literal in Host is where the browser really connected), and the names
        # given with --allow-host.
        own = (*OWN, f"10.1.2.3:{port}", f"{socket.gethostname()}:{port}", "runs.example.org")
        for host in own:
            assert raw_get(port, "/api/runs", host.format(port=port))[0] == 200, host


def test_metrics_on_loopback_answers_only_loopback_names(tmp_path: Path) -> None:
    with metrics(tmp_path, "127.0.0.1") as (port, log):
        assert "warning" not in log
        for host in FOREIGN:
            for path in ("/metrics", "/health"):
                status, body = raw_get(port, path, host.format(port=port))
                assert status == 403 and SECRET_MODEL.encode() not in body, (host, path)
        for host in OWN:
            status, body = raw_get(port, "/metrics", host.format(port=port))
            assert status == 200 and SECRET_MODEL.encode() in body, host


def test_metrics_on_all_interfaces_warns_and_refuses_foreign_names(tmp_path: Path) -> None:
    with metrics(tmp_path, "0.0.0.0", allow=("prom-target.svc",)) as (port, log):
        warning = [line for line in log.splitlines() if line.startswith("warning")]
        assert len(warning) == 1 and "monitor.metrics_host" in warning[0], log
        assert "0.0.0.0" in warning[0] and "127.0.0.1" in warning[0]
        for host in FOREIGN:
            status, body = raw_get(port, "/metrics", host.format(port=port))
            assert status == 403 and SECRET_MODEL.encode() not in body, host
        for host in (*OWN, f"192.168.7.9:{port}", "prom-target.svc:9109", socket.gethostname()):
            assert raw_get(port, "/metrics", host.format(port=port))[0] == 200, host


def test_the_dashboard_command_warns_once_on_all_interfaces_and_exits_143_on_sigterm(
    runs: Path,
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "leantune", "dashboard", str(runs), "--host", "0.0.0.0",
         "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("dashboard: http://0.0.0.0:")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    warning = [line for line in err.splitlines() if line.startswith("warning")]
    assert len(warning) == 1 and "--host 0.0.0.0" in warning[0] and "--allow-host" in warning[0]
    assert proc.returncode == 143 and "Traceback" not in err, err


def test_an_allowed_host_must_be_a_name(tmp_path: Path) -> None:
    bad = run_cli(["dashboard", str(tmp_path), "--allow-host", "http://runs.example.org"])
    assert bad.code == 2 and "--allow-host" in bad.err and "host name" in bad.err
    data = tmp_path / "train.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "a"}, '
                    '{"role": "assistant", "content": "b"}]}\n')  # fmt: skip
    with pytest.raises(ConfigError, match=r"monitor\.metrics_allowed_hosts: 'prom:9109'"):
        load_config(None, [f"data.train={data}", "monitor.metrics_allowed_hosts=a.org,prom:9109"])
