"""Every size a scenario sets is bounded, far above the built-in scenarios and the paper's settings, so a scenario
file cannot make `coral allocate` or `coral run` take unbounded memory or time; each refusal names the field, the
value and the bound."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from coral.catalog import schema
from coral.catalog.loader import CoralInputError, builtin_scenarios, load_scenario
from coral.experiments.paper import waterfall_settings


def core() -> dict[str, Any]:
    return load_scenario("core").model_dump(mode="json", exclude_none=True)


def model(name: str) -> dict[str, Any]:
    return {**core()["models"][0], "model": name}


def configs(n: int) -> list[str]:
    return [f"{k}xGPU{i}" for i in range(n) for k in (1, 2, 4, 8)][:n]


CASES = [  # (field changes, what the error must say)
    ({"epochs": 1_000_000_000}, ["epochs:", "less than or equal to 1000", "1000000000"]),
    ({"epoch_minutes": 1e6}, ["epoch_minutes:", "less than or equal to 1440", "1000000.0"]),
    ({"models": [model(f"m{i}") for i in range(257)]}, ["models:", "at most 256 items", "not 257"]),
    ({"regions": [f"r{i}" for i in range(65)]}, ["regions:", "at most 64 items", "not 65"]),
    ({"configs": configs(65)}, ["configs:", "at most 64 items", "not 65"]),
    ({"description": "x" * 2001}, ["description:", "at most 2000 characters"]),
    ({"models": [{**model("phi-4"), "request_classes": [{"share": 1 / 17, "mean_input_tokens": 1,
                                                         "mean_output_tokens": 1}] * 17}]},
     ["models.0.request_classes.list", "at most 16 items", "not 17"]),
    ({"availability": {"mode": "headroom", "factor": 1e9}}, ["availability.AvailabilityHeadroom.factor:", "less than or equal "
                                                             "to 100", "1000000000.0"]),
    ({"availability_schedule": {"steps": [{"at_s": 0}] * 10_001}}, ["availability_schedule.steps:",
                                                                    "at most 10000 items", "not 10001"]),
    ({"configs": configs(30), "n_max": 8}, ["configs, n_max: 30 configs with n_max 8 make 48,903,491 node sets",
                                            "more than the 5,000,000 allowed"]),
    ({"epochs": 1000, "epoch_minutes": 60}, ["models.request_rate, epochs, epoch_minutes: a run of 1000 epochs of 60 "
                                             "minutes at 30 requests/s simulates 108,000,000 requests",
                                             "more than the 10,000,000 allowed"]),
    ({"name": "core$(touch${IFS}x)"}, ["name: String should match pattern", "'core$(touch${IFS}x)'"]),
]


@pytest.mark.parametrize(("changes", "says"), CASES, ids=lambda v: ",".join(v) if isinstance(v, dict) else "")
def test_each_bound_refuses_naming_field_value_and_bound(tmp_path: Path, changes: dict[str, Any],
                                                         says: list[str]) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump({**core(), **changes}))
    with pytest.raises(CoralInputError) as err:
        load_scenario(path)
    for text in says:
        assert text in str(err.value)


@pytest.mark.parametrize("name", builtin_scenarios())
def test_built_in_scenarios_and_paper_settings_sit_well_inside_the_bounds(name: str) -> None:
    sc = load_scenario(name)
    assert len(waterfall_settings(sc)) > 1  # each paper setting validated as a scenario
    rate = sum(m.request_rate for m in sc.models)
    assert rate * sc.epochs * sc.epoch_minutes * 60 * 10 < schema.MAX_RUN_REQUESTS
    assert len(sc.models) * 4 <= schema.MAX_SCENARIO_MODELS and sc.epochs * 100 < schema.MAX_EPOCHS
    assert len(sc.configs) * 2 < schema.MAX_SCENARIO_CONFIGS and len(sc.regions) * 10 < schema.MAX_SCENARIO_REGIONS


def test_a_run_longer_than_the_request_bound_is_refused_before_anything_is_drawn():
    """`coral simulate core --duration 1e9` ran on (30 billion requests) instead of refusing."""
    from typer.testing import CliRunner

    from coral.cli.main import app
    from coral.workload.traces import workload_for

    res = CliRunner().invoke(app, ["simulate", "core", "--duration", "1e9"])
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "duration: 1e+09 s" in text and "at most 10,000,000 requests" in text
    with pytest.raises(CoralInputError, match="duration"):
        workload_for(load_scenario("core"), float("inf"), 0)
    assert sum(len(r) for r in workload_for(load_scenario("core"), 60.0, 0).values()) > 0
