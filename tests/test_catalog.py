"""Catalog data files load, and bad input gets an error naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from coral.catalog.loader import CoralInputError, builtin_catalog, load_scenario, model_from_hf_config
from coral.catalog.schema import parse_config_name


def test_builtin_catalog_has_required_gpus_models_and_regions() -> None:
    cat = builtin_catalog()
    for gpu in ("T4", "L4", "A10G", "V100", "A100-40G", "A100-80G", "L40S", "H100", "H200"):
        assert gpu in cat.gpus
    for m in ("phi-4", "gpt-oss-20b", "qwen3-32b", "llama-3-70b", "gpt-oss-120b", "qwen3-235b", "llama-2-70b",
              "llama-3-8b"):
        assert m in cat.models
    assert {"aws-us-east-2", "aws-ap-northeast-2", "gcp-us-central1"} <= set(cat.regions())
    for o in cat.offerings:
        assert o.price_per_hour > 0 and o.source and o.price_date


def test_scenarios_match_paper_setup() -> None:
    core, ext = load_scenario("core"), load_scenario("extended")
    assert (len(core.models), len(core.configs), len(core.regions)) == (3, 12, 2)
    assert (len(ext.models), len(ext.configs), len(ext.regions)) == (6, 20, 3)
    slo = {m.model: (m.prefill_slo_ms, m.decode_slo_ms) for m in ext.models}
    assert slo["qwen3-235b"] == (1800, 120) and slo["gpt-oss-20b"] == (900, 30)


def test_hf_config_import() -> None:
    cfg = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 14336, "vocab_size": 128256, "torch_dtype": "bfloat16"}
    m = model_from_hf_config("my-llama", cfg)
    assert m.num_hidden_layers == 32 and not m.is_moe
    with pytest.raises(CoralInputError, match="num_hidden_layers"):
        model_from_hf_config("broken", {**cfg, "num_hidden_layers": -1})


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ("prefill_slo_ms: 1200", "prefill_slo_ms: -5"),
        ("model: phi-4", "model: no-such-model"),
        ("[1xL4,", "[3xL4,"),
    ],
)
def test_bad_scenario_names_the_field(tmp_path: Path, patch: str, field: str) -> None:
    from coral.catalog.loader import data_path

    text = data_path("scenarios", "core.yaml").read_text().replace(patch, field, 1)
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(CoralInputError) as err:
        load_scenario(path)
    msg = str(err.value)
    assert "bad.yaml" in msg
    assert any(k in msg for k in ("prefill_slo_ms", "models.0.model", "configs"))


def test_malformed_yaml_and_unknown_gpu(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("name: [unclosed\n")
    with pytest.raises(CoralInputError, match="malformed"):
        load_scenario(path)
    with pytest.raises(CoralInputError, match="unknown GPU 'B300'"):
        builtin_catalog().node_config("2xB300")
    with pytest.raises(ValueError, match="must look like"):
        parse_config_name("L4")


def test_user_adds_a_model_from_hf_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from typer.testing import CliRunner

    from coral.cli.main import app

    monkeypatch.setenv("CORAL_HOME", str(tmp_path / "home"))
    builtin_catalog.cache_clear()
    cfg = {"num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
           "intermediate_size": 18944, "vocab_size": 152064, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    try:
        res = CliRunner().invoke(app, ["models", "add", "qwen2.5-7b", str(tmp_path / "config.json")])
        assert res.exit_code == 0, res.output
        assert builtin_catalog().model("qwen2.5-7b").num_hidden_layers == 28
        (tmp_path / "bad.json").write_text(json.dumps({**cfg, "num_key_value_heads": 5}))
        res = CliRunner().invoke(app, ["models", "add", "bad", str(tmp_path / "bad.json")])
        assert res.exit_code == 2 and "num_key_value_heads" in res.output
        assert not (tmp_path / "home" / "models" / "bad.yaml").exists()
    finally:
        monkeypatch.delenv("CORAL_HOME")
        builtin_catalog.cache_clear()


def test_user_adds_a_model_by_hf_id_from_the_local_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from typer.testing import CliRunner

    from coral.cli.main import app

    monkeypatch.setenv("CORAL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    builtin_catalog.cache_clear()
    cfg = {"num_hidden_layers": 24, "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2,
           "intermediate_size": 11008, "vocab_size": 151936}
    try:
        res = CliRunner().invoke(app, ["models", "add", "q3b", "--hf-id", "Qwen/Qwen2.5-3B"])
        assert res.exit_code == 2 and "local Hugging Face cache" in res.output and "config.json" in res.output
        snap = tmp_path / "hub" / "models--Qwen--Qwen2.5-3B" / "snapshots" / "abc123"
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(json.dumps(cfg))
        res = CliRunner().invoke(app, ["models", "add", "q3b", "--hf-id", "Qwen/Qwen2.5-3B"])
        assert res.exit_code == 0, res.output
        added = builtin_catalog().model("q3b")
        assert (added.num_hidden_layers, added.hf_id) == (24, "Qwen/Qwen2.5-3B")
        assert (tmp_path / "home" / "models" / "q3b.yaml").exists()
        res = CliRunner().invoke(app, ["models", "add", "x", "--hf-id", "not-an-id"])
        assert res.exit_code == 2 and "ORG/NAME" in res.output
        res = CliRunner().invoke(app, ["models", "add", "x"])
        assert res.exit_code == 2 and "--hf-id" in res.output
    finally:
        monkeypatch.delenv("CORAL_HOME")
        builtin_catalog.cache_clear()


def test_scenario_availability_schedule_is_checked(tmp_path: Path) -> None:
    from coral.catalog.loader import data_path

    base = data_path("scenarios", "core.yaml").read_text()
    good = base + "availability_schedule:\n  steps:\n    - {at_s: 0, counts: {aws-us-east-2: {1xL4: 4}}}\n" \
                  "    - {at_s: 600, counts: {aws-us-east-2: {1xL4: 1}}}\n"
    (tmp_path / "ok.yaml").write_text(good)
    sched = load_scenario(tmp_path / "ok.yaml").availability_schedule
    assert sched is not None and sched.at(700)["aws-us-east-2"]["1xL4"] == 1
    (tmp_path / "bad.yaml").write_text(good.replace("{1xL4: 1}", "{9xL4: 1}"))
    with pytest.raises(CoralInputError, match="availability_schedule"):
        load_scenario(tmp_path / "bad.yaml")
