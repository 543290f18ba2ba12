"""`leantune dashboard` under hostile or damaged run folders: each run's files are parsed with
limits and once per version, and whatever is wrong with one run shows in that run's row only."""

from __future__ import annotations

import http.client
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import run_cli, serving, write_jsonl

from leantune.config.parse import ConfigError, ParseError, load_yaml
from leantune.monitor.dashboard import make_server
from leantune.monitor.dashboard import runs as dash_runs
from leantune.monitor.dashboard.server import DashboardServer
from leantune.training.checks import load_config

# "Billion laughs": 9 levels of 9 aliases, 387,420,489 strings from 520 bytes. Parsed with plain
# yaml.safe_load it is a handful of shared lists; whatever walks it as a tree (JSON, a copy, a
# repr in an error message) walks all of them.
BOMB = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n' + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True)
)


def synthetic_run(root: Path, name: str, steps: int) -> Path:
    run = root / name
    run.mkdir(parents=True)
    cfg = {"model": {"path": "org/tiny-model"}, "method": {"name": "lora"},
           "train": {"max_steps": 20}}  # fmt: skip
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = [{"step": s, "loss": 3.0 - s / 10} for s in range(1, steps + 1)]
    write_jsonl(run / "metrics.jsonl", rows)
    return run


def get(server: DashboardServer, path: str) -> tuple[int, Any]:
    host, port = server.server_address[0], server.server_address[1]
    conn = http.client.HTTPConnection(str(host), int(port), timeout=60)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        body = r.read()
        return r.status, json.loads(body) if r.status == 200 else body
    finally:
        conn.close()


def rows(server: DashboardServer) -> dict[str, dict[str, Any]]:
    status, listed = get(server, "/api/runs")
    assert status == 200, listed
    return {r["name"]: r for r in listed["runs"]}


# --------------------------------------------------------------------------------------------
# The shared YAML loader (config files of `train` and the dashboard's config.yaml)


def test_the_shared_yaml_loader_refuses_aliases_that_expand_past_its_bound() -> None:
    with pytest.raises(ParseError, match=r"config\.yaml: .*alias"):
        load_yaml(BOMB, "config.yaml")
    # Merge keys repeat a mapping's pairs at each level: bounded the same way.
    merges = "a: &a {x: 1, y: 2}\n" + "".join(
        f"{b}: &{b} {{<<: [{', '.join([f'*{a}'] * 9)}]}}\n"
        for a, b in zip("abcdefgh", "bcdefghi", strict=True)
    )
    with pytest.raises(ParseError, match="alias"):
        load_yaml(merges, "merges.yaml")
    # Anchors as people use them (a shared block, a merge) still load, with their values.
    ok = "base: &b {lr: 0.001, steps: 4}\nrun1: *b\nrun2: {<<: *b, steps: 8}\n"
    data, _ = load_yaml(ok, "ok.yaml")
    assert data == {"base": {"lr": 0.001, "steps": 4}, "run1": {"lr": 0.001, "steps": 4},
                    "run2": {"lr": 0.001, "steps": 8}}  # fmt: skip


def test_train_refuses_an_alias_bomb_naming_the_file(tmp_path: Path) -> None:
    # The whole chain as the first item of a list[str] field: without the bound, the message
    # that says the item is not a string repr()s its 387 million strings.
    levels = ['&a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]'] + [
        f"&{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi", strict=True)
    ]
    config = tmp_path / "bomb.yaml"
    config.write_text(f"method:\n  target_modules: [[{', '.join(levels)}]]\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"{config.name}: .*alias"):
        load_config(config)


def test_report_refuses_a_run_whose_config_is_an_alias_bomb(tmp_path: Path) -> None:
    # yaml.safe_load and str() of a setting would end in a MemoryError: the bounded loader
    # refuses it, a damaged config.yaml, named (exit 2), as any other.
    run = tmp_path / "run"
    run.mkdir()
    (run / "leantune_run.json").write_text("{}")
    (run / "config.yaml").write_text(BOMB + "train:\n  memory_budget: *i\n")
    write_jsonl(run / "metrics.jsonl", [{"step": 1, "loss": 2.0}])
    done = run_cli(["report", str(run)])
    assert done.code == 2 and not (run / "report.html").exists(), done
    assert str(run / "config.yaml") in done.err and "alias" in done.err, done.err


# --------------------------------------------------------------------------------------------
# Limits, caching and isolation in the dashboard


def test_an_alias_bomb_in_one_run_marks_that_row_and_the_others_are_listed(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "runs"
    synthetic_run(root, "good", 3)
    bomb = synthetic_run(root, "bomb", 2)
    (bomb / "config.yaml").write_text(BOMB)
    with serving(root) as server:
        first = rows(server)
        assert first["good"]["status"] == "incomplete" and first["good"]["steps_done"] == 3
        assert first["good"]["method"] == "lora"
        assert first["bomb"]["status"] == "error" and first["bomb"]["steps_done"] == 2
        assert "config.yaml" in first["bomb"]["reason"] and "alias" in first["bomb"]["reason"]
        status, detail = get(server, "/api/runs/bomb")
        assert status == 200 and detail["config"] is None and "alias" in detail["config_error"]
        parsed = server.folder.files.parses
        for _ in range(3):
            assert rows(server) == first
        assert server.folder.files.parses == parsed  # nothing unchanged is parsed again
    err = capfd.readouterr().err
    assert err.count("run bomb:") == 1, err  # one line when the run went bad, not one per poll
    assert "Traceback" not in err


def test_a_file_is_parsed_again_only_when_it_changes(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    runs = [synthetic_run(root, f"r{i}", 2) for i in range(3)]
    with serving(root) as server:
        rows(server)
        parsed = server.folder.files.parses
        assert parsed >= 3  # each config.yaml once
        rows(server)
        assert server.folder.files.parses == parsed
        config = runs[1] / "config.yaml"
        config.write_text(config.read_text().replace("max_steps: 20", "max_steps: 300"))
        os.utime(config, ns=(0, config.stat().st_mtime_ns + 10**9))
        assert rows(server)["r1"]["max_steps"] == 300
        assert server.folder.files.parses == parsed + 1


def test_a_config_over_the_size_limit_is_named_in_its_row(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    run = synthetic_run(root, "big", 1)
    with (run / "config.yaml").open("a") as f:
        f.write("# " + "x" * (2 << 20) + "\n")
    with serving(root) as server:
        row = rows(server)["big"]
    assert row["status"] == "error" and "config.yaml" in row["reason"]
    assert "MiB" in row["reason"]


def test_any_failure_reading_one_run_is_that_runs_row_logged_once_per_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard behind the checks above: whatever else a run's files can raise stays in its row
    (or, for its own page, one 500), and the log says it when it appears and when it clears."""
    root = tmp_path / "runs"
    synthetic_run(root, "good", 3)
    synthetic_run(root, "odd", 2)
    real_status = dash_runs.run_status

    def status(run_dir: Path, *args: Any) -> Any:
        if run_dir.name == "odd":
            raise TypeError("'<' not supported between instances of 'str' and 'int'")
        return real_status(run_dir, *args)

    def checkpoints(*_: Any) -> list[int]:
        raise KeyError("step")

    lines: list[str] = []
    server = make_server(root, log=lines.append)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        with monkeypatch.context() as mp:
            mp.setattr(dash_runs, "run_status", status)
            for _ in range(3):
                listed = rows(server)
                assert listed["good"]["status"] == "incomplete"
                assert listed["odd"]["status"] == "error" and "TypeError" in listed["odd"]["reason"]
            mp.setattr(dash_runs.RunsFolder, "_checkpoints", checkpoints)
            for _ in range(2):
                status_code, body = get(server, "/api/runs/good")
                assert status_code == 500 and b"KeyError" in body
        assert rows(server)["odd"]["status"] == "incomplete"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert len(lines) == 3, lines
    assert lines[0].startswith("dashboard: run odd: cannot read this run: TypeError")
    assert "/api/runs/good" in lines[1] and "KeyError" in lines[1]
    assert lines[2] == "dashboard: run odd: readable again"


DAMAGE = {
    "step-not-an-integer": ("metrics.jsonl", '{"step": "abc", "loss": 1.0}\n'),
    "step-a-list": ("metrics.jsonl", '{"step": [1], "loss": 1.0}\n'),
    "fingerprint-a-list": ("leantune_run.json", '{"fingerprint": [1, 2]}'),
    "summary-a-list": ("summary.json", "[1, 2, 3]"),
    "summary-steps-text": ("summary.json", '{"steps": "all"}'),
    "stop-event-step-text": ("events.jsonl", '{"kind": "stop", "step": "x", "message": 5}\n'),
    "event-kind-a-list": ("events.jsonl", '{"kind": ["stop"], "step": 1}\n'),
    "config-a-list": ("config.yaml", "- 1\n- 2\n"),
    "config-sections-text": ("config.yaml", "model: x\nmethod: 3\ntrain: [1]\n"),
    "plan-a-list": ("memory_plan.json", "[1]"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_file_in_one_run_leaves_the_others_as_they_were(
    tmp_path: Path, damage: str, capfd: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "runs"
    synthetic_run(root, "good", 3)
    with serving(root) as server:
        alone = rows(server)["good"]
    bad = synthetic_run(root, "bad", 2)
    name, text = DAMAGE[damage]
    with (bad / name).open("a" if name.endswith(".jsonl") else "w") as f:
        f.write(text)
    with serving(root) as server:
        listed = rows(server)
        status, detail = get(server, "/api/runs/bad")
        assert get(server, "/api/runs/bad/metrics")[0] == 200
        assert get(server, "/api/runs/bad/events")[0] == 200
    assert {k: v for k, v in listed["good"].items() if k != "updated"} == {
        k: v for k, v in alone.items() if k != "updated"
    }
    assert status == 200 and detail["name"] == "bad"
    assert isinstance(listed["bad"]["steps_done"], int)
    assert "Traceback" not in capfd.readouterr().err
