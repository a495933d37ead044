"""One plan from `coral run` to `coral serve`: the scenario's current plan is what serve starts from, at its cost."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from coral.http_serving import free_port
from coral.runtime.handmade import make_instance, make_plan
from coral.templates.store import load_library


@pytest.mark.timeout(180)
def test_coral_serve_starts_from_the_current_plan_at_its_cost(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    cached = Path("out") / "core.templates.sqlite"
    if cached.exists():
        shutil.copy(cached, out / cached.name)
    load_library("core", out)  # rebuilt when the copy is stale
    current = make_plan([make_instance("phi-4", "prefill", [(40, ["1xL40S"])], 9000.0),
                         make_instance("phi-4", "decode", [(40, ["1xL4"])], 500.0)], scenario="core")
    current.save(out / "core.current.plan.json")
    port = free_port()
    cmd = [sys.executable, "-m", "coral.cli.main", "serve", "core", "--port", str(port), "--time-scale", "0.001",
           "--interval", "3600", "--db", str(tmp_path / "serve.sqlite")]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"})
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "dashboard http" in line:
                break
        said = "".join(lines)
        assert re.search(r"plan: out/core\.current\.plan\.json, the current plan of core .*"
                         rf"\${current.cost_per_hour:,.2f}/h", said), said
        deadline = time.monotonic() + 60
        while True:
            try:
                state = httpx.get(f"http://127.0.0.1:{port}/state", timeout=5).json()
                if state.get("plan") and all(i["state"] == "ready" for i in state["instances"]) and state["instances"]:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve never came up with its plan"
            time.sleep(0.2)
        assert state["plan"]["cost_per_hour"] == current.cost_per_hour
        assert sorted(i["id"] for i in state["instances"]) == sorted(i.id for i in current.instances)
    finally:
        proc.terminate()
        proc.wait(20)


def test_serve_without_a_current_plan_says_it_plans_with_the_allocator(tmp_path: Path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from coral.cli.main import app

    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["serve", "core", "--db", str(tmp_path / "s.sqlite"), "--port", "1"])
    assert "core has no current plan (out/core.current.plan.json" in " ".join(res.output.split())
