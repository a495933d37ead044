"""Measured profiles (Helix layout as published) through the perf-model interface, and per-GPU calibration."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from coral.catalog.loader import CoralInputError, builtin_catalog, data_path
from coral.cli.main import app
from coral.perf import Phase, RooflineModel, Workload
from coral.perf.measured import (
    EFFICIENCY_BOUNDS,
    LayerProfile,
    MeasuredModel,
    ProfileManifest,
    ProfileSet,
    calibrate,
    error_summary,
    infer_config,
    read_layer_profile,
    relative_errors,
)
from coral.perf.roofline import EfficiencyOverride, PerfParams

CAT = builtin_catalog()
W = Workload(1024, 128)
LLAMA = CAT.model("llama-2-70b")

# First rows of Helix's published files (Thesys-lab/Helix-ASPLOS25 simulator/model_manager/llama2_70b/), verbatim.
HELIX_L4X2_DECODE = "0,0\n2,3.6\n4,3.7\n6,3.7\n8,3.7\n10,3.8\n12,3.8\n14,3.9\n16,3.9\n18,4.2\n20,4.2"
HELIX_A100_PROMPT = "0,0\n250,2\n500,4\n750,5\n1000,8\n1250,9\n1500,11"
HELIX_T4X4_DECODE = "0,0\n2,2.0\n4,2.1\n6,2.2\n8,2.3\n10,2.3"


def write(folder: Path, sub: str, name: str, text: str) -> None:
    (folder / sub).mkdir(parents=True, exist_ok=True)
    (folder / sub / name).write_text(text)


def helix_copy(folder: Path) -> Path:
    write(folder, "l4x2", "decode_bs2time.csv", HELIX_L4X2_DECODE)
    write(folder, "a100", "prompt_bs2time.csv", HELIX_A100_PROMPT)
    write(folder, "t4x4", "decode_bs2time.csv", HELIX_T4X4_DECODE)
    return folder


def test_reads_helix_files_as_published(tmp_path: Path) -> None:
    helix_copy(tmp_path)
    with pytest.raises(CoralInputError, match=r"'a100'.*A100-40G, A100-80G.*--map a100="):
        ProfileSet.read(tmp_path)  # two catalog GPUs are A100s: the folder must be mapped
    pset = ProfileSet.read(tmp_path, {"a100": "1xA100-40G"})
    assert set(pset.profiles) == {("2xL4", Phase.DECODE), ("1xA100-40G", Phase.PREFILL), ("4xT4", Phase.DECODE)}
    l4 = pset.profiles[("2xL4", Phase.DECODE)]
    assert list(l4.tokens) == [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]  # the 0,0 row is skipped
    assert l4.seconds[0] == pytest.approx(3.6e-3) and l4.seconds[-1] == pytest.approx(4.2e-3)
    assert float(pset.profiles[("1xA100-40G", Phase.PREFILL)](375)) == pytest.approx(3e-3)


def test_manifest_maps_folders_and_names_the_workload(tmp_path: Path) -> None:
    helix_copy(tmp_path)
    (tmp_path / "profile.yaml").write_text(
        "model: llama-2-70b\ninput_tokens: 750\noutput_tokens: 240\nconfigs: {a100: 1xA100-40G}\n")
    pset = ProfileSet.read(tmp_path)
    assert pset.manifest.model == "llama-2-70b" and pset.manifest.workload == Workload(750, 240)
    assert ("1xA100-40G", Phase.PREFILL) in pset.profiles
    pset = ProfileSet.read(tmp_path, {"a100": "8xA100-40G"})  # an explicit mapping wins
    assert ("8xA100-40G", Phase.PREFILL) in pset.profiles


@pytest.mark.parametrize(("folder", "config"), [("l4", "1xL4"), ("l4x2", "2xL4"), ("t4x4", "4xT4"),
                                                ("v100", "1xV100"), ("h100x8", "8xH100"), ("2xL40S", "2xL40S")])
def test_infer_config_from_folder_names(folder: str, config: str) -> None:
    assert infer_config(folder, CAT) == config


def test_header_from_coral_profiler_is_accepted(tmp_path: Path) -> None:
    write(tmp_path, "1xL4", "decode_bs2time.csv", "tokens,ms\n1,2.0\n8,2.5\n")
    prof = read_layer_profile(tmp_path / "1xL4" / "decode_bs2time.csv")
    assert list(prof.tokens) == [1, 8] and prof.seconds[1] == pytest.approx(2.5e-3)


@pytest.mark.parametrize(("text", "match"), [("0,0\n2,-1\n", "positive"), ("0,0\n2,abc\n", "row 2"),
                                             ("0,0\n", "no rows"), ("0,0\n2,1,5\n", "two numbers"),
                                             ("0,0\n2,1\n2,3\n", "once")])
def test_bad_profile_files(tmp_path: Path, text: str, match: str) -> None:
    write(tmp_path, "l4", "decode_bs2time.csv", text)
    with pytest.raises(CoralInputError, match=match):
        MeasuredModel.from_folder(tmp_path)


def test_missing_or_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(CoralInputError, match="no such profile folder"):
        MeasuredModel.from_folder(tmp_path / "missing")
    (tmp_path / "l4").mkdir()
    with pytest.raises(CoralInputError, match="no <config>"):
        MeasuredModel.from_folder(tmp_path)


def test_helix_profile_drives_step_time_and_throughput(tmp_path: Path) -> None:
    write(tmp_path, "l4", "decode_bs2time.csv", "0,0\n1,2.0\n16,2.5\n64,4.0")
    pm = MeasuredModel.from_folder(tmp_path)
    node = CAT.node_config("1xL4")
    assert float(pm.step_time(LLAMA, Phase.DECODE, node, 4, 16, W)) == pytest.approx(4 * 2.5e-3)
    assert float(pm.step_time(LLAMA, Phase.DECODE, node, 2, 40, W)) == pytest.approx(2 * 3.25e-3)
    thr, batch = pm.throughput_table(LLAMA, Phase.DECODE, node, 0.1, 1, W)
    j = 4
    per_layer = float(pm.profiles[("1xL4", Phase.DECODE)](batch[j]))
    assert batch[j] > 0 and thr[j] == pytest.approx(batch[j] / (j * per_layer))
    ref = RooflineModel()  # no prefill profile: roofline
    assert float(pm.step_time(LLAMA, Phase.PREFILL, node, 4, 512, W)) == float(
        ref.step_time(LLAMA, Phase.PREFILL, node, 4, 512, W))


def synthetic_profiles(truth: PerfParams, configs: list[str]) -> ProfileSet:
    """Per-layer profiles that the roofline with `truth` reproduces exactly."""
    pm = RooflineModel(truth)
    batches = {Phase.PREFILL: np.array([256.0, 1024, 4096, 8192]), Phase.DECODE: np.array([1.0, 16, 64, 256, 512])}
    profiles = {}
    for config in configs:
        node = CAT.node_config(config)
        for phase, b in batches.items():
            profiles[(config, phase)] = LayerProfile(b, pm.layer_time(LLAMA, phase, node, b, W))
    return ProfileSet(profiles, ProfileManifest())


def test_calibration_recovers_known_per_gpu_factors() -> None:
    base = RooflineModel()
    truth_o = EfficiencyOverride(compute_efficiency=0.45, memory_efficiency=0.7, attention_efficiency=0.3,
                                 interconnect_efficiency=0.25)
    truth = base.params.model_copy(update={"gpu_overrides": {"L4": truth_o}, "gpu_fallbacks": {}})
    pset = synthetic_profiles(truth, ["1xL4", "2xL4"])
    params, fits = calibrate(base, LLAMA, pset, W, "test")
    (fit,) = fits
    assert fit.gpu == "L4" and fit.at_bounds == () and fit.rms_log_error < 0.01
    got = params.gpu_overrides["L4"]
    for name in ("compute_efficiency", "memory_efficiency", "attention_efficiency", "interconnect_efficiency"):
        assert getattr(got, name) == pytest.approx(getattr(truth_o, name), rel=0.03), name
    assert got.source == "test"
    errs = relative_errors(RooflineModel(params), LLAMA, pset, W)
    assert max(error_summary(e)[1] for e in errs.values()) < 0.02


def test_calibration_flags_parameters_at_bounds() -> None:
    """Times no physical efficiency explains (faster than peak) push the fit to its upper bound."""
    fast = PerfParams.load().model_copy(update={"compute_efficiency": 1.0, "memory_efficiency": 1.0,
                                                "attention_efficiency": 1.0, "gpu_overrides": {}})
    pset = synthetic_profiles(fast, ["1xT4"])
    pset = ProfileSet({k: LayerProfile(p.tokens, p.seconds / 3) for k, p in pset.profiles.items()}, pset.manifest)
    _, (fit,) = calibrate(RooflineModel(), LLAMA, pset, W, "test")
    assert set(fit.at_bounds) == {"compute_efficiency", "memory_efficiency", "attention_efficiency"}
    assert fit.override.compute_efficiency == pytest.approx(EFFICIENCY_BOUNDS[1])


def test_fallback_gpus_use_the_fitted_sibling_and_must_resolve() -> None:
    p = PerfParams.load()
    for gpu, other in p.gpu_fallbacks.items():
        assert p.for_gpu(gpu).compute_efficiency == p.gpu_overrides[other].compute_efficiency
    with pytest.raises(ValueError, match=r"gpu_fallbacks\.H100"):
        PerfParams.model_validate({**p.model_dump(), "gpu_fallbacks": {"H100": "B200"}})


def test_shipped_sample_and_defaults_agree() -> None:
    """The shipped Helix sample reads as published, and the shipped defaults were fitted to it."""
    pset = ProfileSet.read(data_path("profiles", "helix-llama2-70b"))
    assert len(pset.profiles) == 14 and pset.manifest.workload == Workload(750, 240)
    errs = relative_errors(RooflineModel(), LLAMA, pset, pset.manifest.workload)
    medians = [error_summary(e)[0] for e in errs.values()]
    assert float(np.median(medians)) < 0.10


def test_cli_calibrate_writes_params_and_warns(tmp_path: Path) -> None:
    fast = PerfParams.load().model_copy(update={"compute_efficiency": 1.0, "memory_efficiency": 1.0,
                                                "attention_efficiency": 1.0, "gpu_overrides": {}})
    pm = RooflineModel(fast)
    node = CAT.node_config("1xT4")
    for phase, name, b in [(Phase.PREFILL, "prompt_bs2time.csv", [250, 1000, 4000]),
                           (Phase.DECODE, "decode_bs2time.csv", [2, 50, 300])]:
        ms = pm.layer_time(LLAMA, phase, node, np.array(b, dtype=float), W) * 1e3 / 3
        write(tmp_path / "prof", "t4", name, "0,0\n" + "\n".join(f"{x},{t:.4f}" for x, t in zip(b, ms, strict=True)))
    out = tmp_path / "params.yaml"
    res = CliRunner().invoke(app, ["perf", "calibrate", str(tmp_path / "prof"), "--model", "llama-2-70b",
                                   "--out", str(out)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "T4 compute_efficiency = 1.000 is at its bound" in res.output
    written = PerfParams.model_validate(yaml.safe_load(out.read_text()))
    assert written.gpu_overrides["T4"].compute_efficiency == 1.0
    res = CliRunner().invoke(app, ["perf", "calibrate", str(tmp_path / "prof"), "--out", str(out)])
    assert res.exit_code != 0 and "--model" in res.output
