"""Request traces (Azure / BurstGPT formats, synthetic generators, rescaling) and availability schedules."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coral.catalog.loader import CoralInputError, data_path, load_scenario
from coral.simulation import load_availability, load_azure, load_burstgpt, rescale, synthetic, workload_for
from coral.workload.traces import (
    SHIPPED_TRACES,
    generate_burstgpt_sample,
    load_trace,
    shipped_path,
    tile,
    write_azure,
)

SC = load_scenario("core")
EXPECTED = {"azure-code": (2048, 28), "azure-conversation": (1155, 211), "burstgpt": (611, 123)}


def test_burstgpt_sample_regenerates_byte_for_byte(tmp_path: Path) -> None:
    p = generate_burstgpt_sample(tmp_path)
    assert p.read_bytes() == shipped_path("burstgpt").read_bytes()
    assert data_path("traces", "README.md").exists()


def test_real_azure_traces_ship_with_licence_and_attribution() -> None:
    folder = shipped_path("azure-code").parent
    assert "Attribution 4.0 International" in (folder / "LICENSE").read_text(encoding="utf-8-sig")
    readme = (folder / "README.md").read_text()
    assert "Splitwise" in readme and "CC-BY 4.0" in readme and "b469a113" in readme
    assert len(load_trace(shipped_path("azure-code"))) == 8819
    assert len(load_trace(shipped_path("azure-conversation"))) == 19366


@pytest.mark.parametrize("trace", sorted(SHIPPED_TRACES))
def test_shipped_traces_match_the_scenario_means(trace: str) -> None:
    reqs = load_trace(shipped_path(trace))
    mi, mo = EXPECTED[trace]
    assert reqs.input_tokens.mean() == pytest.approx(mi, rel=0.02)
    assert reqs.output_tokens.mean() == pytest.approx(mo, rel=0.02)
    assert (np.diff(reqs.arrival_s) >= 0).all() and reqs.arrival_s[0] == 0
    for sm in load_scenario("extended").models:
        if sm.trace == trace:
            assert (sm.mean_input_tokens, sm.mean_output_tokens) == (mi, mo)


def test_azure_timestamps_iso_offset_and_seconds(tmp_path: Path) -> None:
    f = tmp_path / "a.csv"
    f.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2024-05-10 00:00:01.5000000+00:00,100,5\n"
        "2024-05-10 00:00:00.0000000+00:00,200,7\n"
        "2024-05-10 00:00:03.2500000+00:00,300,9\n"
    )
    r = load_azure(f)
    assert r.arrival_s.tolist() == [0.0, 1.5, 3.25]
    assert r.input_tokens.tolist() == [200, 100, 300] and r.output_tokens.tolist() == [7, 5, 9]
    g = tmp_path / "b.csv"
    g.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n10,1,1\n12.5,2,2\n")
    assert load_azure(g).arrival_s.tolist() == [0.0, 2.5]


def test_azure_round_trip(tmp_path: Path) -> None:
    reqs = synthetic(3.0, 60.0, 500, 50, seed=1)
    back = load_azure(write_azure(reqs, tmp_path / "t.csv"))
    np.testing.assert_allclose(back.arrival_s, reqs.arrival_s, atol=1e-7)
    assert (back.input_tokens == reqs.input_tokens).all() and (back.output_tokens == reqs.output_tokens).all()


def test_burstgpt_drops_failures_and_filters(tmp_path: Path) -> None:
    f = tmp_path / "b.csv"
    f.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,100,10,110,Conversation log\n"
        "6,GPT-4,200,0,200,API log\n"
        "8,GPT-4,300,30,330,API log\n"
    )
    r = load_burstgpt(f)
    assert r.arrival_s.tolist() == [0.0, 3.0] and r.input_tokens.tolist() == [100, 300]
    assert load_burstgpt(f, model="GPT-4").input_tokens.tolist() == [300]
    with pytest.raises(CoralInputError, match="no successful"):
        load_burstgpt(f, log_type="nope")


def test_bad_trace_files_name_the_problem(tmp_path: Path) -> None:
    f = tmp_path / "x.csv"
    f.write_text("TIMESTAMP,ContextTokens\n1,2\n")
    with pytest.raises(CoralInputError, match="GeneratedTokens"):
        load_azure(f)
    f.write_text("foo,bar\n1,2\n")
    with pytest.raises(CoralInputError, match="neither"):
        load_trace(f)
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1,many,2\n")
    with pytest.raises(CoralInputError, match="ContextTokens"):
        load_azure(f)
    with pytest.raises(CoralInputError, match="cannot read"):
        load_azure(tmp_path / "missing.csv")


def test_rescale_and_tile_keep_the_target_rate() -> None:
    base = load_trace(shipped_path("burstgpt"))
    fast = rescale(base, 25.0)
    assert fast.rate == pytest.approx(25.0)
    assert (fast.input_tokens == base.input_tokens).all()
    long = tile(fast, 600.0, seed=4)
    assert len(long) == pytest.approx(25 * 600, rel=0.01)
    assert (np.diff(long.arrival_s) >= 0).all() and long.arrival_s[-1] < 600
    assert (tile(fast, 600.0, seed=4).arrival_s == long.arrival_s).all()
    other = tile(fast, 600.0, seed=5)
    n = min(len(other), len(long))
    assert not (other.input_tokens[:n] == long.input_tokens[:n]).all()
    assert sorted(other.input_tokens[: len(base)]) == sorted(
        base.input_tokens
    )  # each pass is the whole trace


@pytest.mark.parametrize("arrival,cv", [("poisson", 1.0), ("gamma", 2.0)])
def test_synthetic_statistics_and_seed(arrival: str, cv: float) -> None:
    r = synthetic(20.0, 2000.0, 800, 100, seed=7, arrival=arrival, cv=cv)  # type: ignore[arg-type]
    gaps = np.diff(r.arrival_s)
    assert len(r) / 2000 == pytest.approx(20, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)
    assert r.input_tokens.mean() == pytest.approx(800, rel=0.05)
    assert r.output_tokens.mean() == pytest.approx(100, rel=0.05)
    again = synthetic(20.0, 2000.0, 800, 100, seed=7, arrival=arrival, cv=cv)  # type: ignore[arg-type]
    assert (again.arrival_s == r.arrival_s).all() and (again.input_tokens == r.input_tokens).all()


def test_workload_for_scenario() -> None:
    """Each full pass over a shipped trace holds all its rows, so long runs (many passes of the bursty real
    traces) hit the scenario's rate."""
    duration = 20_000.0
    w = workload_for(SC, duration, seed=2)
    assert set(w) == {m.model for m in SC.models}
    for sm in SC.models:
        assert len(w[sm.model]) == pytest.approx(sm.request_rate * duration, rel=0.03)
    half = workload_for(SC, duration, seed=2, rate_scale=0.5)
    assert len(half["phi-4"]) == pytest.approx(len(w["phi-4"]) / 2, rel=0.03)
    assert (workload_for(SC, 1000, seed=3)["phi-4"].input_tokens[:50] != w["phi-4"].input_tokens[:50]).any()


def test_trace_option_takes_files_and_shipped_trace_names(tmp_path: Path) -> None:
    from coral.cli.simulate import parse_traces

    models = [m.model for m in SC.models]
    f = tmp_path / "t.csv"
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n")
    got = parse_traces(["gpt-oss-20b=azure-conversation", f"phi-4={f}"], models)
    assert got == {"gpt-oss-20b": shipped_path("azure-conversation"), "phi-4": f}
    assert parse_traces(["azure-code"], models) == dict.fromkeys(models, shipped_path("azure-code"))
    with pytest.raises(CoralInputError, match="not a model"):
        parse_traces(["llama=azure-code"], models)


def test_workload_unknown_trace_is_refused() -> None:
    bad = SC.model_copy(update={"models": [SC.models[0].model_copy(update={"trace": "sharegpt"})]})
    with pytest.raises(CoralInputError, match="sharegpt"):
        workload_for(bad, 10, seed=0)


# --- availability ---------------------------------------------------------------------------------------------
def test_availability_schedule_yaml_and_csv(tmp_path: Path) -> None:
    y = tmp_path / "a.yaml"
    y.write_text(
        "schema_version: 1\nsteps:\n"
        "  - {at_s: 0, counts: {aws-us-east-2: {1xL40S: 4, 1xL4: 8}}}\n"
        "  - {at_s: 600, counts: {aws-us-east-2: {1xL40S: 1}}}\n"
    )
    s = load_availability(y, SC)
    assert s.at(0) == {"aws-us-east-2": {"1xL40S": 4, "1xL4": 8}}
    assert s.at(700) == {"aws-us-east-2": {"1xL40S": 1, "1xL4": 8}}
    c = tmp_path / "a.csv"
    c.write_text("time_s,region,config,count\n0,aws-us-east-2,1xL40S,4\n600,aws-us-east-2,1xL40S,1\n")
    assert load_availability(c, SC).at(599) == {"aws-us-east-2": {"1xL40S": 4}}
    c.write_text("time_s,region,config,count\n0,mars-1,1xL40S,4\n")
    with pytest.raises(CoralInputError, match="mars-1"):
        load_availability(c, SC)
    y.write_text("schema_version: 1\nsteps:\n  - {at_s: 5, counts: {}}\n  - {at_s: 1, counts: {}}\n")
    with pytest.raises(CoralInputError, match="non-decreasing"):
        load_availability(y)
