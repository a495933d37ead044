"""The static report rendered by headless Chromium: its numbers match the plan; screenshot to artifacts/."""

from __future__ import annotations

import os
import re
from html import unescape
from pathlib import Path

import pytest

from coral.catalog.loader import builtin_catalog
from coral.report import build_report
from coral.report.browser import chromium_binary, run_chromium
from coral.report.examples import example_baseline, example_inputs, example_plan

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"

# Locally a missing browser skips; in CI (CI=true, .ci/install-browser ran) it must be there, so the tests run.
pytestmark = [pytest.mark.browser, pytest.mark.skipif(
    chromium_binary() is None and os.environ.get("CI") != "true",
    reason="Debian's chromium is not installed (CI installs it with .ci/install-browser)",
)]


def money(v: float) -> str:
    return f"${v:,.2f}/h"


def text_of(dom: str, element_id: str) -> str:
    match = re.search(rf'id="{element_id}"[^>]*>([^<]*)<', dom)
    assert match, f"#{element_id} not rendered"
    return unescape(match.group(1))


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("report") / "report.html"
    path.write_text(build_report(example_plan(), baselines=[example_baseline()], sim=example_inputs()))
    return path


@pytest.fixture(scope="module")
def dom(page: Path) -> str:
    return run_chromium(page.as_uri(), dump_dom=True)


def test_rendered_numbers_match_the_plan(dom: str) -> None:
    plan, base = example_plan(), example_baseline()
    assert 'data-rendered="1"' in dom
    assert text_of(dom, "total-cost") == money(plan.cost_per_hour)
    assert text_of(dom, "n-instances") == str(len(plan.instances))
    ratio = base.cost_per_hour / plan.cost_per_hour
    assert text_of(dom, "ratio-homo") == f"{ratio:.2f}× cheaper"
    for s in plan.serving:
        row = re.search(rf'<tr data-model="{s.model}" data-phase="{s.phase}">(.*?)</tr>', dom)
        assert row, (s.model, s.phase)
        assert money(s.cost_per_hour) in row.group(1)


def test_cost_bars_match_the_breakdown(dom: str) -> None:
    plan = example_plan()
    by_model: dict[str, float] = {}
    for inst in plan.instances:
        by_model[inst.model] = by_model.get(inst.model, 0.0) + inst.cost_per_hour
    section = dom[dom.index('id="cost-model"') : dom.index('id="cost-phase"')]
    bars = dict(re.findall(r'data-label="([^"]+)">([^<]+)<', section))
    assert bars == {m: money(v) for m, v in by_model.items()}


def test_every_instance_and_node_is_drawn(dom: str) -> None:
    plan = example_plan()
    counts = [int(c) for c in re.findall(r'class="card instance"[^>]*data-count="(\d+)"', dom)]
    assert sum(counts) == len(plan.instances)
    # one box per node of each distinct instance layout
    distinct = {(i.model, i.phase, i.template_id, i.region): i for i in plan.instances}
    assert dom.count('class="node"') == sum(i.n_nodes for i in distinct.values())
    assert "layers 44–63 (20)" in dom
    assert dom.count('class="slo-line"') == 6


def test_screenshot_goes_to_artifacts(page: Path) -> None:
    shot = ARTIFACTS / "report.png"
    shot.unlink(missing_ok=True)
    run_chromium(page.as_uri(), screenshot=shot, window=(1400, 2000))
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1400, 2000)
    assert len(data) > 50_000  # a blank page compresses to ~13 kB; the drawn report is far larger


def test_slo_verdicts_method_runs_engines_and_time_series_are_drawn(tmp_path: Path) -> None:
    from coral.report.inputs import MethodResult, TimeSeries
    from coral.report.view import view_model

    plan = example_plan()
    inputs = example_inputs().model_copy(update={
        "overall_attainment": 0.8,
        "methods": [MethodResult(method="coral", how="plan held fixed", slo_attainment=0.8, by_model={"phi-4": 0.7}),
                    MethodResult(method="homo", how="plan held fixed", slo_attainment=0.85)],
        "timeseries": TimeSeries(t_s=[0, 10, 20], bin_s=10, rate={"phi-4": [1, 2, 3]},
                                 ttft_p99_ms={"phi-4": [100, 5000, None]}, tpot_p99_ms={"phi-4": [20, 30, 40]},
                                 queue={"phi-4": [0, 4, 1]}),
        "plan_fingerprint": "0" * 16,
    })
    vm = view_model(plan, baselines=[example_baseline()], sim=inputs)
    path = tmp_path / "report.html"
    path.write_text(build_report(plan, baselines=[example_baseline()], sim=inputs))
    dom = run_chromium(path.as_uri(), dump_dom=True)
    verdicts = [r[k] for r in vm["slo"]["models"] for k in ("ttft_pass", "tpot_pass", "pass") if r[k] is not None]
    assert dom.count('class="badge pass"') == verdicts.count(True)
    # + the overall verdict (80% < 90%) and homo's simulated attainment on its comparison card (85% < 90%)
    assert dom.count('class="badge fail"') == verdicts.count(False) + 2
    assert re.search(r'id="ratio-homo".*?<span class="attainment" data-value="0.85"[^>]*>85.0% within SLOs '
                     r'<span class="badge fail">', dom, re.S)
    assert re.search(r'id="slo-overall"[^>]*data-value="0.8"', dom)
    assert len(re.findall(r'<tr data-method="[^"]+" data-how=', dom)) == 2
    groups = vm["instance_groups"]
    assert dom.count(">Coral engine<") == len(groups)
    assert dom.count(">vLLM<") == sum(g["engines"]["vllm"] for g in groups)
    assert dom.count(">not stock vLLM<") == sum(not g["engines"]["vllm"] for g in groups)
    for key in ("rate", "queue", "ttft_p99_ms", "tpot_p99_ms"):
        assert f'id="ts-{key}"' in dom
    assert "another plan" in dom  # the fingerprint does not match the plan
    assert 'id="saving-homo"' in dom and "Where the saving comes from" in dom


def test_threshold_attainment_engine_and_what_to_rent_as_rendered(tmp_path: Path) -> None:
    """A vLLM plan checked against a 97 % target: the page states the engine, uses 97 % for every verdict and
    caption, gives each baseline's attainment beside its cost, and opens with what to rent."""
    from test_report_view import checked

    from coral.deploy.bom import bill_of_materials

    models = ["gpt-oss-20b", "phi-4", "qwen3-32b"]
    plan = checked(example_plan(), dict.fromkeys(models, 0.99), 0.97, engine="vllm")
    base = checked(example_baseline(), {"gpt-oss-20b": 0.99, "phi-4": 0.93, "qwen3-32b": 0.98}, 0.97)
    path = tmp_path / "report.html"
    path.write_text(build_report(plan, baselines=[base], sim=example_inputs()))
    dom = run_chromium(path.as_uri(), dump_dom=True)

    assert re.search(r'<h1 id="title" data-engine="vllm">Coral plan — core \(coral\) for stock vLLM</h1>', dom)
    assert "<title>Coral plan — core (coral) for stock vLLM</title>" in dom
    assert text_of(dom, "slo-target") == "97.0%"
    captions = re.findall(r'<div class="(short|sub) within" data-value="([^"]+)" data-target="([^"]+)">([^<]+)<', dom)
    assert len(captions) == 6 and {float(c[2]) for c in captions} == {0.97}
    for cls, value, _, text in captions:
        assert (cls == "short") == (float(value) < 0.97), text  # red exactly below the plan's target
        assert text.endswith("SLO (target 97.0%)")
    assert {c[0] for c in captions} == {"short", "sub"}  # the example has both sides of 97 %
    card = re.search(r'id="ratio-homo"[^>]*>([^<]+)</div><div class="hint">(.*?)</div>', dom, re.S)
    assert card and unescape(card.group(1)) == f"{base.cost_per_hour / plan.cost_per_hour:.2f}× cheaper"
    hint = re.sub(r"<[^>]+>", "", unescape(card.group(2)))
    served = min(x.served_fraction for x in base.serving)
    assert hint == f"{money(base.cost_per_hour)} · 93.0% within SLOs fail · serves {100 * served:.1f}%"
    assert re.search(r'<tr data-method="homo">.*?<td class="short" data-value="0.93"[^>]*>93.0%</td>', dom)

    # what to rent: first section, numbers as in the bill of materials, total = the plan's cost
    assert dom.index('id="bom"') < dom.index('id="slo"') < dom.index('class="kpis"')
    bom = bill_of_materials(plan, builtin_catalog())
    for r in bom.rows:
        row = re.search(rf'<tr data-instance-type="{re.escape(r.instance_type)}" data-region="{r.region}">(.*?)</tr>',
                        dom, re.S)
        assert row, r.instance_type
        cells = dict(re.findall(r'<td class="(count|each|total)"[^>]*>([^<]+)<', row.group(1)))
        assert cells == {"count": str(r.count), "each": f"${r.price_per_hour:.4f}", "total": money(r.total_per_hour)}
    total = re.search(r'id="bom-total" data-value="([^"]+)"><b>([^<]+)</b>', dom)
    assert total and float(total.group(1)) == pytest.approx(plan.cost_per_hour)
    assert total.group(2) == money(plan.cost_per_hour)
    assert "The total equals the plan's cost" in text_of(dom, "bom-check")
