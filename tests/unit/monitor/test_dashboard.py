"""`leantune dashboard`: the JSON API over real and synthetic run directories, what it refuses
to serve, the command, and the pages in headless Chromium (Debian's `chromium`)."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import yaml
from cdp import Browser, Page
from support import chat_rows, make_config, run_cli, serving, write_jsonl

from leantune.monitor.dashboard import runs as dash_runs
from leantune.monitor.dashboard import status as dash_status
from leantune.monitor.dashboard.server import DashboardServer
from leantune.monitor.events import read_events
from leantune.monitor.metrics import read_metrics
from leantune.testing.faults import LOSS_SCALE_ENV
from leantune.training.recipe import train

DOCS = Path(__file__).resolve().parents[3] / "docs"
SCREENSHOT_ENV = "LEANTUNE_DASHBOARD_SCREENSHOT"
"""Set to 1 to copy the run page's screenshot to docs/dashboard.png (the README's)."""
SECRET = "TOP-SECRET-9f3b1c"


# --------------------------------------------------------------------------------------------
# Run directories and a server over them


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    """A finished 16-step LoRA run with periodic evals and checkpoints, and a loss spike at
    step 10 that the guard rolls back (so events.jsonl holds loss_spike + rollback)."""
    folder = tmp_path_factory.mktemp("dash_real")
    data = write_jsonl(folder / "train.jsonl", chat_rows(24))
    held_out = write_jsonl(folder / "eval.jsonl", chat_rows(4, offset=100))
    run = folder / "runs" / "tiny"
    cfg = make_config(
        tiny_llama_dir, data, run, f"data.eval={held_out}", "data.pack=false",
        "train.max_steps=16", "train.save_every=4", "train.keep_last=5", "train.eval_every=4",
        "train.lr=1e-3", "guard.loss_spike=rollback", "guard.warmup=3",
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(LOSS_SCALE_ENV, "10:50")
        train(cfg, log=lambda _: None)
    return run


def metrics_row(step: int, loss: float, **extra: Any) -> dict[str, Any]:
    return {"step": step, "loss": loss, "lr": 1e-3 * step, "grad_norm": 0.5 + step / 10,
            "tokens_per_s": 100.0 * step, "rss_bytes": 2**28 + step * 2**20,
            "peak_mem_bytes": 2**28 + step * 2**20, **extra}  # fmt: skip


def synthetic_run(
    root: Path,
    name: str,
    steps: int,
    *,
    events: list[dict[str, Any]] | None = None,
    paused: dict[str, Any] | None = None,
    summary: dict[str, Any] | None = None,
    max_steps: int = 20,
) -> Path:
    """A run directory as a run would leave it, without training: config, metrics, events."""
    run = root / name
    run.mkdir(parents=True)
    cfg = {"model": {"path": "org/tiny-model"}, "method": {"name": "qlora"},
           "train": {"max_steps": max_steps}}  # fmt: skip
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    write_jsonl(run / "metrics.jsonl", [metrics_row(s, 3.0 - s / 10) for s in range(1, steps + 1)])
    if events:
        write_jsonl(run / "events.jsonl", [{"time": 1.0, **e} for e in events])
    if paused is not None:
        (run / "PAUSED").write_text(json.dumps(paused))
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    return run


def request(
    server: DashboardServer, path: str, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One request with `path` sent exactly as given (no client-side normalisation)."""
    host, port = server.server_address[0], server.server_address[1]
    conn = http.client.HTTPConnection(str(host), int(port), timeout=30)
    try:
        conn.putrequest(method, path, skip_host=headers is not None and "Host" in headers)
        for key, value in (headers or {}).items():
            conn.putheader(key, value)
        conn.endheaders()
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def no_nan(text: str) -> None:
    raise AssertionError(f"{text} in a JSON answer: a browser's JSON.parse refuses it")


def api(server: DashboardServer, path: str) -> Any:
    status, headers, body = request(server, path)
    assert status == 200, (path, status, body[:300])
    assert headers["content-type"].startswith("application/json")
    return json.loads(body, parse_constant=no_nan)


# --------------------------------------------------------------------------------------------
# The API


def test_the_run_list_gives_each_runs_state_and_exit_reason(real_run: Path, tmp_path: Path) -> None:
    root = tmp_path / "runs"
    shutil.copytree(real_run, root / "tiny")  # as if synced from another machine
    stop = {"step": 6, "kind": "stop", "message": "stopped; checkpoint runs/x/step-000005"}
    synthetic_run(root, "stopped", 5, events=[{"step": 6, "kind": "grad_norm", "message": "x"},
                                              stop])  # fmt: skip
    signal_event = {"step": 4, "kind": "signal", "message": "SIGTERM: stopped before step 4"}
    synthetic_run(root, "interrupted", 3, events=[signal_event])
    oom = {"step": 3, "kind": "oom", "message": "out of memory at step 3 with mbs=1"}
    halved = {"step": 2, "kind": "oom", "message": "micro-batch 2 -> 1", "micro_batch_size": 1}
    synthetic_run(root, "oom", 2, events=[halved, oom])
    synthetic_run(root, "halved", 4, events=[halved])  # an OOM recovered from ends nothing
    pause = {"step": 8, "kind": "pause", "message": "paused; checkpoint c"}
    marker = {"reason": "loss 88 is 20x the median", "step": 8}
    synthetic_run(root, "paused", 7, paused=marker, events=[pause])
    synthetic_run(root, "resumed", 9, events=[signal_event])  # steps after the signal: killed
    synthetic_run(root, "group/nested", 2, summary={"steps": 2})
    (root / "not-a-run").mkdir()
    (root / "not-a-run" / "notes.txt").write_text("x")
    synthetic_run(root, ".hidden", 1)
    with serving(root) as server:
        listed = api(server, "/api/runs")
    runs = {r["name"]: r for r in listed["runs"]}
    assert list(runs) == sorted(
        ["tiny", "stopped", "interrupted", "oom", "halved", "paused", "resumed", "group/nested"]
    )
    state = {name: (r["status"], r["reason"]) for name, r in runs.items()}
    assert state["stopped"] == ("stopped", stop["message"])
    assert state["interrupted"] == ("interrupted", signal_event["message"])
    assert state["oom"] == ("out_of_memory", oom["message"])
    assert state["halved"][0] == "incomplete"
    assert state["paused"] == ("paused", "paused at step 8: loss 88 is 20x the median")
    assert state["resumed"][0] == "incomplete"
    assert state["group/nested"] == ("finished", "finished after 2 steps")
    assert state["tiny"] == ("finished", "finished after 16 steps")
    metrics = read_metrics(real_run / "metrics.jsonl")
    evals = read_metrics(real_run / "eval.jsonl")
    tiny = runs["tiny"]
    assert (tiny["method"], tiny["steps_done"], tiny["max_steps"]) == ("lora", 16, 16)
    assert tiny["model"].endswith("tiny_llama0") and tiny["pid"] is None
    assert tiny["last_loss"] == metrics[-1]["loss"]
    assert tiny["last_eval_loss"] == evals[-1]["eval_loss"]
    stopped = runs["stopped"]
    assert (stopped["method"], stopped["model"]) == ("qlora", "org/tiny-model")
    assert (stopped["steps_done"], stopped["max_steps"]) == (5, 20)
    assert stopped["last_loss"] == pytest.approx(2.5)


def test_a_run_page_gets_config_summary_checkpoints_and_every_series(real_run: Path) -> None:
    with serving(real_run.parent) as server:
        detail = api(server, "/api/runs/tiny")
        metrics = api(server, "/api/runs/tiny/metrics")
        evals = api(server, "/api/runs/tiny/eval")
        events = api(server, "/api/runs/tiny/events")
        later = api(server, "/api/runs/tiny/events?after=1")
    assert detail["config_text"] == (real_run / "config.yaml").read_text()
    assert detail["config"]["method"]["name"] == "lora"
    assert detail["summary"] == json.loads((real_run / "summary.json").read_text())
    assert detail["checkpoints"] == [0, 4, 8, 12, 16] and detail["has_final"]
    plan = json.loads((real_run / "memory_plan.json").read_text())  # written by train
    assert detail["planned_peak_bytes"] == plan["peak_bytes"] > 0
    assert detail["status"] == "finished"
    assert metrics["rows"] == read_metrics(real_run / "metrics.jsonl")
    assert [r["step"] for r in metrics["rows"]] == list(range(1, 17))
    assert metrics["last"]["step"] == 16 and not metrics["reset"]
    assert evals["rows"] == read_metrics(real_run / "eval.jsonl")
    assert [r["step"] for r in evals["rows"]] == [4, 8, 12, 16]
    assert events["events"] == read_events(real_run / "events.jsonl")
    assert [e["kind"] for e in events["events"]] == ["loss_spike", "rollback"]
    assert [e["kind"] for e in later["events"]] == ["rollback"] and later["count"] == 2


def test_series_are_incremental_and_start_over_when_the_file_is_rewritten(tmp_path: Path) -> None:
    run = synthetic_run(tmp_path, "live", 3)
    path = run / "metrics.jsonl"
    with serving(tmp_path) as server:
        first = api(server, "/api/runs/live/metrics")
        assert [r["step"] for r in first["rows"]] == [1, 2, 3]
        last = first["last"]
        with path.open("a") as f:
            f.write(json.dumps(metrics_row(4, 1.5)) + "\n")
        new = api(server, f"/api/runs/live/metrics?after={last['step']}&sig={last['sig']}")
        assert new["rows"] == [metrics_row(4, 1.5)] and not new["reset"]
        last = new["last"]
        assert api(server, f"/api/runs/live/metrics?after=4&sig={last['sig']}")["rows"] == []
        # A rollback/resume cuts the file back and appends other rows: the client starts over.
        write_jsonl(path, [metrics_row(1, 3.0), metrics_row(2, 2.0), metrics_row(3, 0.25)])
        with path.open("a") as f:
            f.write(json.dumps(metrics_row(4, 0.125)) + "\n")
        again = api(server, f"/api/runs/live/metrics?after=4&sig={last['sig']}")
        assert again["reset"] and [r["loss"] for r in again["rows"]] == [3.0, 2.0, 0.25, 0.125]
        wrong = api(server, "/api/runs/live/metrics?after=2&sig=00000000")
        assert wrong["reset"] and len(wrong["rows"]) == 4
        # A new file in its place (run.resume=never moved the old run aside): read afresh.
        last = wrong["last"]
        write_jsonl(tmp_path / "new.jsonl", [metrics_row(1, 9.0)])
        os.replace(tmp_path / "new.jsonl", path)
        fresh = api(server, f"/api/runs/live/metrics?after={last['step']}&sig={last['sig']}")
        assert fresh["reset"] and [r["loss"] for r in fresh["rows"]] == [9.0]
        status, _, body = request(server, "/api/runs/live/metrics?after=two")
        assert status == 400 and b"after" in body


def test_a_torn_last_line_is_skipped_until_it_is_whole(tmp_path: Path) -> None:
    run = synthetic_run(tmp_path, "live", 2)
    path = run / "metrics.jsonl"
    with path.open("a") as f:
        f.write("not json at all\n")  # a damaged line in the middle is skipped too
        f.write('{"step": 3, "loss": 0.7, "lr": 0.0')  # the writer is mid-line
    with serving(tmp_path) as server:
        rows = api(server, "/api/runs/live/metrics")["rows"]
        assert [r["step"] for r in rows] == [1, 2]
        assert api(server, "/api/runs")["runs"][0]["last_loss"] == pytest.approx(2.8)
        with path.open("a") as f:
            f.write('1, "grad_norm": NaN}\n')
            f.write(json.dumps(metrics_row(4, float("inf"))) + "\n")
        rows = api(server, "/api/runs/live/metrics")["rows"]  # parse_constant refuses NaN
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[2] == {"step": 3, "loss": 0.7, "lr": 0.01, "grad_norm": "NaN"}
    assert rows[3]["loss"] == "Infinity"


LOCKER = """
import sys
from pathlib import Path
from leantune.training.run.rundir import lock_run_dir
fd = lock_run_dir(Path(sys.argv[1]))
print("locked", flush=True)
sys.stdin.read()
"""


def test_a_run_whose_lock_another_process_holds_is_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = synthetic_run(tmp_path, "live", 4)
    proc = subprocess.Popen(
        [sys.executable, "-c", LOCKER, str(run)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"

        def refuse(*_: Any) -> None:
            raise AssertionError("the dashboard took the run's lock")

        with serving(tmp_path) as server, monkeypatch.context() as mp:
            mp.setattr(dash_status.fcntl, "flock", refuse)  # /proc/locks, not the lock itself
            live = api(server, "/api/runs/live")
            assert (live["status"], live["pid"]) == ("running", proc.pid)
            assert live["reason"] == f"training (pid {proc.pid})"
        # Without /proc/locks: a non-blocking probe, and the pid the lock file holds.
        monkeypatch.setattr(dash_status, "PROC_LOCKS", tmp_path / "no-proc-locks")
        assert dash_status.lock_holder(run) == proc.pid
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    assert dash_status.lock_holder(run) is None
    monkeypatch.undo()
    assert dash_status.lock_holder(run) is None
    with serving(tmp_path) as server:
        assert api(server, "/api/runs/live")["status"] == "incomplete"


def test_a_run_folder_that_vanishes_mid_read_is_a_503_not_a_dropped_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synthetic_run(tmp_path, "live", 2)

    def gone(*_: Any) -> None:
        raise FileNotFoundError("checkpoints")

    monkeypatch.setattr(dash_runs.RunsFolder, "_checkpoints", gone)
    with serving(tmp_path) as server:
        status, _, body = request(server, "/api/runs/live")
        assert status == 503 and b"try again" in body
        assert api(server, "/api/runs")["runs"][0]["name"] == "live"  # the rest still answers


# --------------------------------------------------------------------------------------------
# Nothing outside RUNS_DIR


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DashboardServer, Path]]:
    """A runs folder with a symlink to a run outside it and a run whose files link outside."""
    base = tmp_path_factory.mktemp("dash_guard")
    outside = base / "outside"
    secret_run = synthetic_run(outside, "run", 3)
    (secret_run / "config.yaml").write_text(f"method: {{name: {SECRET}}}\n")
    write_jsonl(secret_run / "events.jsonl", [{"step": 1, "kind": "stop", "message": SECRET}])
    (outside / "secret.txt").write_text(SECRET)
    root = base / "runs"
    synthetic_run(root, "ok", 2)
    os.symlink(secret_run, root / "escape")
    os.symlink(secret_run, root / "ok" / "inner-link")
    linked = root / "linked"
    linked.mkdir()
    os.symlink(outside / "secret.txt", linked / "config.yaml")
    os.symlink(secret_run / "metrics.jsonl", linked / "metrics.jsonl")
    os.symlink(secret_run / "events.jsonl", linked / "events.jsonl")
    with serving(root) as server:
        yield server, outside


def _attacks(outside: Path) -> list[str]:
    secret = str(outside / "secret.txt")
    run = str(outside / "run")
    return [
        "/static/../../../outside/secret.txt",
        "/static/../server.py",
        "/static/..%2fserver.py",
        "/static/%2e%2e/%2e%2e/%2e%2e/outside/secret.txt",
        "/static/%2e%2e%2f%2e%2e%2f%2e%2e%2foutside%2fsecret.txt",
        "/static/%252e%252e/%252e%252e/%252e%252e/outside/secret.txt",
        "/static/%25252e%25252e/outside/secret.txt",
        "/static/" + secret,
        "/static/" + quote(secret, safe=""),
        "/" + secret,
        "//" + secret.lstrip("/"),
        "/api/runs/../../outside/run",
        "/api/runs/%2e%2e/%2e%2e/outside/run",
        "/api/runs/%2e%2e%2f%2e%2e%2foutside%2frun/metrics",
        "/api/runs/%252e%252e%252f%252e%252e%252foutside%252frun",
        "/api/runs/" + run,
        "/api/runs/" + quote(run, safe=""),
        "/api/runs/" + run + "/events",
        "/api/runs/escape",
        "/api/runs/escape/metrics",
        "/api/runs/escape/events",
        "/api/runs/ok/inner-link",
        "/api/runs/ok/inner-link/events",
        "/api/runs/ok/../escape/events",
        "/api/runs/ok/config.yaml",
        "/api/runs/.%2e/outside/run",
        "/api/runs/ok%00/metrics",
        "/api/runs/ok%5c..%5c..%5coutside%5crun",
        "/run/escape",
        "/run/../../outside/secret.txt",
        "/run/%2e%2e/%2e%2e/outside/secret.txt",
        "/static/%ff%fe",
        "http://127.0.0.1/../outside/secret.txt",
        "*",
    ]


def test_nothing_outside_the_runs_folder_is_served(guarded: tuple[DashboardServer, Path]) -> None:
    server, outside = guarded
    for path in _attacks(outside):
        status, _, body = request(server, path)
        assert status in (400, 403, 404), (path, status, body[:200])
        assert SECRET.encode() not in body, path
    listed = api(server, "/api/runs")
    assert [r["name"] for r in listed["runs"]] == ["linked", "ok"]
    assert SECRET not in json.dumps(listed)
    # A run inside whose files link outside: served, without those files.
    for path in ("/api/runs/linked", "/api/runs/linked/metrics", "/api/runs/linked/events"):
        status, _, body = request(server, path)
        assert status == 200 and SECRET.encode() not in body, path
    assert api(server, "/api/runs/linked")["config_text"] is None
    assert api(server, "/api/runs/linked/metrics")["rows"] == []


def test_only_get_and_head_from_the_expected_host(guarded: tuple[DashboardServer, Path]) -> None:
    server, _ = guarded
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
        status, headers, _ = request(server, "/api/runs", method)
        assert (status, headers.get("allow")) == (405, "GET, HEAD"), method
    status, headers, body = request(server, "/api/runs/ok", "HEAD")
    full = request(server, "/api/runs/ok")[2]
    assert status == 200 and body == b"" and int(headers["content-length"]) == len(full)
    status, headers, body = request(server, "/static/leanchart.js")
    assert status == 200 and headers["content-type"].startswith("text/javascript")
    assert headers["x-content-type-options"] == "nosniff"
    assert "default-src 'self'" in headers["content-security-policy"]
    # A page whose domain is re-pointed at 127.0.0.1 (DNS rebinding) sends its own Host.
    status, _, body = request(server, "/api/runs", headers={"Host": "attacker.example:8470"})
    assert status == 403 and b"ok" not in body
    port = server.server_address[1]
    assert request(server, "/api/runs", headers={"Host": f"localhost:{port}"})[0] == 200


def test_every_page_asset_is_served_by_leantune(guarded: tuple[DashboardServer, Path]) -> None:
    """No CDN: each script, style and icon a page names is one of the package's files."""
    server, _ = guarded
    static = Path(dash_runs.__file__).parent / "static"
    for page in ("/", "/run/ok"):
        html = request(server, page)[2].decode()
        refs = [part.split('"')[0] for part in html.split('="')[1:]]
        assets = [r for r in refs if r.startswith(("/static/", "http", "//"))]
        assert assets and all(a.startswith("/static/") for a in assets), assets
        for asset in assets:
            status, _, body = request(server, asset)
            assert status == 200 and body == (static / asset.removeprefix("/static/")).read_bytes()
    for script in static.glob("*.js"):
        assert "http://" not in script.read_text() and "https://" not in script.read_text()


# --------------------------------------------------------------------------------------------
# The command


def test_the_command_serves_a_folder_and_refuses_what_it_cannot(tmp_path: Path) -> None:
    missing = run_cli(["dashboard", str(tmp_path / "nope")])
    assert missing.code == 2 and "does not exist" in missing.err
    assert run_cli(["dashboard", str(tmp_path), "--port", "70000"]).code == 2
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = run_cli(["dashboard", str(tmp_path), "--port", str(taken.getsockname()[1])])
    assert busy.code == 2 and "cannot listen" in busy.err and "--port" in busy.err
    synthetic_run(tmp_path / "runs", "one", 3)
    proc = subprocess.Popen(
        [sys.executable, "-m", "leantune", "dashboard", str(tmp_path / "runs"), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("dashboard: http://127.0.0.1:"), line
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/api/runs")
        runs = json.loads(conn.getresponse().read())["runs"]
        conn.close()
        assert [(r["name"], r["steps_done"], r["status"]) for r in runs] == [
            ("one", 3, "incomplete")
        ]
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err  # the exit-code table's SIGINT, as for every command
    assert "Traceback" not in err


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT-inherited-ignored", "SIGTERM"]
)
def test_the_command_stops_with_130_or_143_on_sigint_or_sigterm_whatever_it_inherited(
    tmp_path: Path, sig: signal.Signals
) -> None:
    # A process started in the background by a shell without job control (a CI script's `&`,
    # nohup) inherits SIGINT ignored; Python then never raises KeyboardInterrupt. The dashboard
    # stops on SIGINT and SIGTERM (docker stop, systemd) however it was started, as `train` does.
    proc = subprocess.Popen(
        [sys.executable, "-m", "leantune", "dashboard", str(tmp_path), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ignore_sigint,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("dashboard: http://127.0.0.1:")
    finally:
        proc.send_signal(sig)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise AssertionError(f"the dashboard did not stop on {sig.name}") from None
    assert proc.returncode == 128 + sig, err  # 130 / 143, as README's exit-code table says
    assert err.strip().splitlines()[-1] == f"dashboard: stopped ({sig.name})", err
    assert "Traceback" not in err


# --------------------------------------------------------------------------------------------
# The pages in headless Chromium


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    b = Browser(tmp_path_factory.mktemp("chromium") / "profile")
    try:
        yield b
    finally:
        b.close()


@pytest.fixture()
def page(browser: Browser) -> Iterator[Page]:
    p = browser.page()
    p.call("Emulation.setDeviceMetricsOverride", width=1400, height=1000, deviceScaleFactor=1,
           mobile=False)  # fmt: skip
    try:
        yield p
    finally:
        p.navigate("about:blank")
        p.close()


def chart(page: Page, name: str) -> dict[str, Any]:
    """What a chart drew: per series its point count and last point, and its marker count."""
    js = f"(e => ({{s: JSON.parse(e.dataset.summary), m: +e.dataset.markers}}))" \
         f"(document.getElementById('chart-{name}'))"  # fmt: skip
    value = page.evaluate(js)
    return {"series": value["s"], "markers": value["m"]}


# Pixels of the train-loss colour (#1f77b4) on the loss canvas: the line was drawn.
TRAIN_PIXELS = """(() => {
  const c = document.querySelector('#chart-loss canvas');
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4) if (d[i] === 31 && d[i+1] === 119 && d[i+2] === 180) n++;
  return n;
})()"""


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_the_run_page_draws_the_runs_numbers(real_run: Path, page: Page, tmp_path: Path) -> None:
    metrics = read_metrics(real_run / "metrics.jsonl")
    evals = read_metrics(real_run / "eval.jsonl")
    last = metrics[-1]
    with serving(real_run.parent) as server:
        page.navigate(server.url + "run/tiny?poll=250")
        page.wait_for("document.body && document.body.dataset.ready === '1'")
        loss = chart(page, "loss")
        assert loss["series"]["train loss"] == {"n": 16, "last": [16, last["loss"]]}
        assert loss["series"]["eval loss"] == {"n": 4, "last": [16, evals[-1]["eval_loss"]]}
        assert chart(page, "lr")["series"]["lr"]["last"] == [16, last["lr"]]
        assert chart(page, "grad")["series"]["grad norm"]["last"] == [16, last["grad_norm"]]
        assert chart(page, "tps")["series"]["tokens/s"]["last"] == [16, last["tokens_per_s"]]
        memory = chart(page, "mem")
        assert memory["series"] == {
            "RSS": {"n": 16, "last": [16, last["rss_bytes"]]},
            "peak": {"n": 16, "last": [16, last["peak_mem_bytes"]]},
        }
        # 2 events (loss_spike, rollback) + 5 checkpoints, on every chart's step axis
        assert {chart(page, c)["markers"] for c in ("loss", "lr", "grad", "tps", "mem")} == {7}
        planned = json.loads((real_run / "memory_plan.json").read_text())["peak_bytes"]
        assert page.evaluate("JSON.parse(document.getElementById('chart-mem').dataset.lines)") == [
            planned
        ]  # fmt: skip  (the planner's peak, drawn as a line)
        assert page.evaluate("document.querySelector('#chart-mem .leanchart-note').textContent") \
            == ""  # fmt: skip
        assert float(page.evaluate("document.getElementById('last-loss').dataset.value")) \
            == last["loss"]  # fmt: skip
        assert page.evaluate("document.getElementById('last-step').textContent") == "16"
        assert page.evaluate("document.getElementById('status').textContent") == "finished"
        kinds = page.evaluate("[...document.querySelectorAll('#events tbody tr')]"
                              ".map(r => r.dataset.kind)")  # fmt: skip
        assert kinds == ["loss_spike", "rollback"]
        assert "max_steps: 16" in page.evaluate("document.getElementById('config').textContent")
        assert page.evaluate(TRAIN_PIXELS) > 100
        shot = page.screenshot(tmp_path / "dashboard.png")
        width, height = png_size(shot)
        assert width == 1400 and height >= 1000 and len(shot) > 50_000
        if os.environ.get(SCREENSHOT_ENV) == "1":
            DOCS.mkdir(exist_ok=True)
            shutil.copyfile(tmp_path / "dashboard.png", DOCS / "dashboard.png")

        page.navigate(server.url + "?poll=250")
        page.wait_for("!!document.querySelector('#runs tbody tr')")
        row = page.evaluate("(r => [r.dataset.run, r.dataset.status, r.cells[3].textContent])"
                            "(document.querySelector('#runs tbody tr'))")  # fmt: skip
        assert row == ["tiny", "finished", "16 / 16"]
        assert page.errors() == []


def test_a_point_appended_to_metrics_jsonl_appears_without_a_reload(
    page: Page, tmp_path: Path
) -> None:
    run = synthetic_run(tmp_path / "runs", "live", 5)
    path = run / "metrics.jsonl"
    with serving(tmp_path / "runs") as server:
        page.navigate(server.url + "run/live?poll=150")
        page.wait_for("document.body && document.body.dataset.ready === '1'")
        assert page.evaluate("document.getElementById('last-step').textContent") == "5"
        page.evaluate("window.sameDocument = 42")
        with path.open("a") as f:
            f.write(json.dumps(metrics_row(6, 1.2345)) + "\n")
        page.wait_for("document.getElementById('last-loss').dataset.value === '1.2345'")
        assert chart(page, "loss")["series"]["train loss"] == {"n": 6, "last": [6, 1.2345]}
        assert page.evaluate("window.sameDocument") == 42  # no reload happened

        with path.open("a") as f:  # a torn line: the page keeps polling without an error
            f.write('{"step": 7, "loss": 0.9')
        polls = page.evaluate("+document.body.dataset.polls")
        page.wait_for(f"+document.body.dataset.polls > {polls + 2}")
        assert page.evaluate("document.getElementById('conn').hidden") is True
        assert page.evaluate("document.getElementById('last-step').textContent") == "6"
        with path.open("a") as f:
            f.write("5}\n")
        page.wait_for("document.getElementById('last-step').textContent === '7'")
        assert chart(page, "loss")["series"]["train loss"]["last"] == [7, 0.95]

        event = {"time": 1.0, "step": 7, "kind": "rollback", "message": "restored step-000004"}
        write_jsonl(run / "events.jsonl", [event])
        page.wait_for("document.querySelectorAll('#events tbody tr').length === 1")
        assert chart(page, "grad")["markers"] == 1

        # A rollback cuts metrics.jsonl back: the charts start over from the file.
        write_jsonl(path, [metrics_row(s, 2.0) for s in (1, 2, 3)] + [metrics_row(4, 0.5)])
        page.wait_for("document.getElementById('last-loss').dataset.value === '0.5'")
        assert chart(page, "loss")["series"]["train loss"] == {"n": 4, "last": [4, 0.5]}
        assert page.evaluate("window.sameDocument") == 42
        assert page.errors() == []


# Pixels of one colour on a chart's canvas: its line was drawn there.
COLOUR_PIXELS = """((id, r, g, b) => {
  const c = document.querySelector('#' + id + ' canvas');
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4) if (d[i] === r && d[i+1] === g && d[i+2] === b) n++;
  return n;
})"""
REWARD_CHARTS = {
    "rewards": {"chosen": "rewards/chosen", "rejected": "rewards/rejected",
                "margin": "rewards/margins"},
    "accuracy": {"accuracy": "rewards/accuracies"},
}  # fmt: skip
"""The reward charts' series, by the metric (metrics.jsonl's name, TRL's) each draws."""


def test_a_dpo_runs_page_draws_its_reward_charts(
    page: Page, tmp_path: Path, tiny_llama_dir: Path
) -> None:
    """A real 4-step DPO run: the rewards chart draws chosen, rejected and margin, the accuracy
    chart the reward accuracy, each point the step's logged value; an SFT run hides both."""
    pairs = [
        {"prompt": f"What is {i} plus {i}?", "chosen": f"It is {2 * i}.", "rejected": f"{i}?"}
        for i in range(8)
    ]
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    runs = tmp_path / "runs"
    dpo = ("train.objective=dpo", "data.format=preference", "data.max_seq_len=auto",
           "train.lr=5e-3", "data.pack=false")  # fmt: skip
    train(make_config(tiny_llama_dir, data, runs / "dpo", *dpo), log=lambda _: None)
    synthetic_run(runs, "sft", 3)
    metrics = read_metrics(runs / "dpo" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert metrics[-1]["rewards/margins"] != 0  # it trained: the reward lines are not flat zero
    with serving(runs) as server:
        page.navigate(server.url + "run/dpo?poll=250")
        page.wait_for("document.body && document.body.dataset.ready === '1'")
        for name, series in REWARD_CHARTS.items():
            assert page.evaluate(f"document.getElementById('chart-{name}').hidden") is False
            drawn = chart(page, name)["series"]
            assert set(drawn) == set(series), name
            for label, key in series.items():
                want = [m[key] for m in metrics]
                assert drawn[label] == {"n": 4, "last": [4, want[-1]]}, (name, label)
        # The margin's line (#1f77b4) and the chosen rewards' (#2ca02c) are on the canvas.
        assert page.evaluate(f"{COLOUR_PIXELS}('chart-rewards', 31, 119, 180)") > 50
        assert page.evaluate(f"{COLOUR_PIXELS}('chart-rewards', 44, 160, 44)") > 50
        assert page.evaluate(f"{COLOUR_PIXELS}('chart-accuracy', 31, 119, 180)") > 50
        assert page.errors() == []
        page.navigate(server.url + "run/sft?poll=250")
        page.wait_for("document.body && document.body.dataset.ready === '1'")
        for name in REWARD_CHARTS:
            assert page.evaluate(f"document.getElementById('chart-{name}').hidden") is True
        assert page.errors() == []
