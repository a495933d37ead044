"""Errors a user meets on the command line: which scenario a name means, 'did you mean', YAML and JSON files that are
malformed or of another kind, and `--help` pages that show no `<bool>` beside a flag."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from conftest import TIERS, status
from typer.testing import CliRunner

from coral.allocation.plan import Plan
from coral.catalog.loader import (
    CoralInputError,
    builtin_catalog,
    check_region_table,
    data_path,
    load_file,
    load_scenario,
    scenario_path,
)
from coral.catalog.schema import Scenario
from coral.catalog.suggest import close_names, did_you_mean
from coral.cli.main import app

runner = CliRunner()
CORE = data_path("scenarios", "core.yaml")


# -- a built-in scenario's name, and a file or folder of that name ---------------------------------------------------


def test_a_builtin_name_wins_over_a_local_folder_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "core").mkdir()
    assert scenario_path("core") == CORE
    assert load_scenario("core").name == "core"
    err = capsys.readouterr().err
    assert "built-in" in err and "folder ./core" in err and "give ./core" in err
    assert err.count("scenario core:") == 1  # said once, however often the name is resolved
    with pytest.raises(CoralInputError, match=r"scenario './core': core is a folder, not a scenario file"):
        load_scenario("./core")


def test_a_builtin_name_wins_over_a_local_file_such_as_a_core_dump(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "core").write_bytes(b"\x7fELF\x02\x01\x01\x00core dump\xff\xfe")
    assert load_scenario("core").name == "core"
    assert "not the file ./core" in capsys.readouterr().err
    with pytest.raises(CoralInputError, match="not UTF-8 text"):
        load_scenario("./core")


def test_a_path_is_a_path_even_with_a_builtin_stem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    text = CORE.read_text().replace("name: core", "name: core-local", 1)
    (tmp_path / "core.yaml").write_text(text)
    assert load_scenario("core.yaml").name == "core-local"
    assert load_scenario("./core.yaml").name == "core-local"
    with pytest.raises(CoralInputError, match=r"scenario 'extended\.yaml': no such file"):
        load_scenario("extended.yaml")


def test_a_local_folder_that_is_no_builtin_name_is_refused_by_name(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    with pytest.raises(CoralInputError, match=r"scenario 'mine': mine is a folder, not a scenario file"):
        load_scenario("mine")


def test_the_cli_reads_the_builtin_scenario_beside_a_local_core(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "core").mkdir()
    res = runner.invoke(app, ["templates", "show", "phi-4", "--region", "aws-us-east-3"])
    assert res.exit_code == 2
    assert "scenario core: using the built-in scenario" in res.stderr
    assert "'aws-us-east-3' is not in scenario core (did you mean 'aws-us-east-2'?)" in res.stderr


# -- did you mean ------------------------------------------------------------------------------------------------------


def test_close_names_ignore_case_and_say_nothing_when_nothing_is_close() -> None:
    assert close_names("l40s", ["L4", "L40S", "H100"])[0] == "L40S"
    assert did_you_mean("qwen3-23b", ["qwen3-32b", "phi-4"]) == " (did you mean 'qwen3-32b'?)"
    assert did_you_mean("zzzz", ["qwen3-32b", "phi-4"]) == ""


@pytest.mark.parametrize(("lookup", "wrong", "hint"), [
    ("model", "qwen3_32b", "unknown model 'qwen3_32b' (did you mean 'qwen3-32b'"),
    ("gpu", "L40", "unknown GPU 'L40' (did you mean 'L40S'"),
    ("node_config", "2xL40s", "unknown GPU 'L40s' (did you mean 'L40S'?)"),
    ("node_config", "L40S", "config 'L40S' must look like '<1|2|4|8>x<GPU>', e.g. '2xL40S' (did you mean '1xL40S'"),
])
def test_catalog_lookups_suggest_the_close_name(lookup: str, wrong: str, hint: str) -> None:
    with pytest.raises(CoralInputError) as err:
        getattr(builtin_catalog(), lookup)(wrong)
    assert hint in str(err.value)


def _scenario_with(tmp_path: Path, old: str, new: str) -> Path:
    text = CORE.read_text()
    assert old in text
    path = tmp_path / "typo.yaml"
    path.write_text(text.replace(old, new, 1))
    return path


@pytest.mark.parametrize(("old", "new", "message"), [
    ("model: phi-4", "model: phi4", "models.0.model: unknown model 'phi4' (did you mean 'phi-4'?)"),
    ("aws-us-east-2", "aws-us-east2", "no offerings known for region 'aws-us-east2' (did you mean 'aws-us-east-2'"),
    ("1xL40S", "1xL40", "unknown GPU 'L40' in '1xL40' (did you mean 'L40S'"),
])
def test_a_scenario_file_with_a_typo_gets_a_suggestion(tmp_path: Path, old: str, new: str, message: str) -> None:
    with pytest.raises(CoralInputError) as err:
        load_scenario(_scenario_with(tmp_path, old, new))
    assert message in str(err.value) and "typo.yaml" in str(err.value)


def test_a_mistyped_builtin_scenario_name_gets_a_suggestion() -> None:
    with pytest.raises(CoralInputError, match=r"'extnded': no such file and not a built-in scenario "
                                              r"\(did you mean 'extended'\?\); built-in: core, extended"):
        load_scenario("extnded")


def test_region_and_config_tables_suggest_the_scenario_names() -> None:
    sc = load_scenario("core")
    with pytest.raises(CoralInputError, match=r"region 'aws-us-east2' is not in the scenario \(did you mean "
                                              r"'aws-us-east-2'"):
        check_region_table({"aws-us-east2": {}}, sc, "market: availability")
    with pytest.raises(CoralInputError, match=r"config '1xl40s' not in scenario \(did you mean '1xL40S'"):
        check_region_table({"aws-us-east-2": {"1xl40s": 1}}, sc, "market: availability")
    data = yaml.safe_load(CORE.read_text())
    data["availability"] = {"aws-us-east-2": {"2xL40": 1}}
    with pytest.raises(ValueError, match=r"config '2xL40' is not in configs \(did you mean '2xL40S'"):
        Scenario.model_validate(data)


def test_perf_commands_suggest_models_and_configs() -> None:
    res = runner.invoke(app, ["perf", "table", "qwen3_32b", "2xL40S"])
    assert res.exit_code == 2 and "unknown model 'qwen3_32b' (did you mean 'qwen3-32b'" in res.stderr
    res = runner.invoke(app, ["perf", "table", "qwen3-32b", "2xL40"])
    assert res.exit_code == 2 and "unknown GPU 'L40' (did you mean 'L40S'" in res.stderr
    res = runner.invoke(app, ["perf", "profile", "--config", "L40S", "--model", "phi-4"])
    assert res.exit_code == 2 and "--config: config 'L40S' must look like" in res.stderr


# -- malformed files, and files of another kind ------------------------------------------------------------------------


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("name: core\nregions: [aws-us-east-2\nconfigs: [1xL4]\n")
    with pytest.raises(CoralInputError) as err:
        load_scenario(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: malformed YAML at line 3, column 8: ")
    assert "while parsing a flow sequence at line 2, column 10" in msg and "<unicode string>" not in msg


def test_a_json_syntax_error_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text('{\n  "scenario": "core",\n}\n')
    with pytest.raises(CoralInputError, match=r"plan\.json: malformed JSON at line 3, column 1: Expecting property"):
        Plan.load(path)


def test_a_folder_given_as_a_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(CoralInputError, match=r"is a folder, not a file"):
        Plan.load(tmp_path)


def test_a_scenario_given_as_a_plan_is_one_line_saying_so(tmp_path: Path) -> None:
    with pytest.raises(CoralInputError) as err:
        Plan.load(CORE)
    msg = str(err.value)
    assert msg == (f"{CORE} is not a plan (it has none of scenario, method, instances, serving, cost_per_hour, solve; "
                   "it looks like a scenario)")


@pytest.mark.parametrize(("document", "looks"), [
    ({"offerings": []}, "; it looks like an offerings file)"),
    ({"num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 10}, "; it looks like a model architecture or Hugging Face"),
    ({"planned_cost_per_hour": {}, "slo_attainment": 0.9, "scenario": "core"}, "like a `coral run` summary.json)"),
    ({"hello": "world"}, "none of scenario, method, instances, serving, cost_per_hour, solve)"),
])
def test_any_json_that_is_not_a_plan_says_what_it_looks_like(tmp_path: Path, document: dict[str, Any],
                                                            looks: str) -> None:
    path = tmp_path / "other.json"
    path.write_text(json.dumps(document))
    with pytest.raises(CoralInputError) as err:
        Plan.load(path)
    msg = str(err.value)
    assert msg.startswith(f"{path} is not a plan (it has ") and looks in msg and len(msg.splitlines()) == 1


@pytest.mark.parametrize(("document", "reason"), [([1, 2], "it holds a list"), (None, "it is empty")])
def test_a_file_that_holds_no_mapping_is_not_a_plan(tmp_path: Path, document: Any, reason: str) -> None:
    path = tmp_path / "odd.json"
    path.write_text(json.dumps(document))
    with pytest.raises(CoralInputError, match=rf"odd\.json is not a plan \({reason}"):
        Plan.load(path)


def test_a_plan_with_a_few_bad_fields_keeps_its_field_errors(tmp_path: Path) -> None:
    good = {"scenario": "core", "method": "coral", "instances": [], "serving": [], "cost_per_hour": 0.0,
            "solve": {"status": "optimal"}}
    assert Plan.model_validate(good).scenario == "core"
    path = tmp_path / "bad.plan.json"
    path.write_text(json.dumps({**good, "cost_per_hour": -1, "engine": "trt"}))
    with pytest.raises(CoralInputError) as err:
        Plan.load(path)
    lines = str(err.value).splitlines()
    assert lines[0] == f"{path}: invalid input"
    assert any(line.startswith("  cost_per_hour: ") and "(got -1)" in line for line in lines)
    assert any(line.startswith("  engine: ") for line in lines) and len(lines) == 3


def test_a_plan_missing_half_its_fields_is_still_checked_field_by_field(tmp_path: Path) -> None:
    path = tmp_path / "half.json"
    path.write_text(json.dumps({"scenario": "core", "method": "coral", "instances": []}))
    with pytest.raises(CoralInputError) as err:
        load_file(Plan, path)
    assert str(err.value).startswith(f"{path}: invalid input") and "serving: Field required" in str(err.value)


def test_a_plan_lacking_most_fields_says_which(tmp_path: Path) -> None:
    path = tmp_path / "thin.json"
    path.write_text(json.dumps({"scenario": "core", "extra": 1}))
    with pytest.raises(CoralInputError, match=r"thin\.json is not a plan \(it has 1 of its 6 required fields; "
                                              r"missing: method, instances, serving, cost_per_hour, solve\)"):
        Plan.load(path)


def test_the_cli_prints_one_line_for_a_scenario_given_as_a_plan(tmp_path: Path) -> None:
    res = runner.invoke(app, ["plan", "bom", str(CORE)])
    assert res.exit_code == 2, res.output
    assert "is not a plan" in res.stderr and "Field required" not in res.stderr


# -- --help --------------------------------------------------------------------------------------------------------------


def _command_paths(command: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = [path]
    for name, sub in getattr(command, "commands", {}).items():
        paths += _command_paths(sub, (*path, name))
    return paths


def test_no_help_page_shows_a_type_beside_a_flag() -> None:
    paths = _command_paths(typer.main.get_command(app))
    assert ("run",) in paths and ("models", "add") in paths and ("deploy",) in paths
    for path in paths:
        res = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert res.exit_code == 0, (path, res.output)
        assert "<bool>" not in res.stdout, path
        assert "--help" in res.stdout
    res = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "200"})
    assert "--allow-miss " in res.stdout and "<float>" in res.stdout  # options that take a value keep their type


# -- the test tiers' lines -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("marker", "command"), [
    ("vllm", "python -m coral.vllm_cpu"), ("browser", "bash .ci/install-browser"), ("cluster", "pip install -e"),
])
def test_a_tier_that_does_not_run_says_what_installs_its_needs(marker: str, command: str) -> None:
    tier = next(t for t in TIERS if t.marker == marker)
    not_selected = status(0, None, tier.needs, tier.install, f"pytest -m {marker}")
    assert not_selected.startswith(f"not selected (pytest -m {marker}; needs ") and command in not_selected
    skipped = status(3, None, tier.needs, tier.install, f"pytest -m {marker}")
    assert skipped.startswith("skipped, ") and "not found" in skipped and command in skipped
    assert status(3, "it", tier.needs, tier.install, "") == "runs 3 test(s) with it"


def test_the_slow_tier_needs_nothing_to_install() -> None:
    assert status(0, None, "", "", "pytest -m slow") == "not selected (pytest -m slow)"
