"""Measured profiles through the perf-model interface, and calibration of efficiency factors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coral.catalog.loader import CoralInputError, builtin_catalog
from coral.perf import Phase, RooflineModel, Workload
from coral.perf.measured import MeasuredModel, calibrate
from coral.perf.roofline import EfficiencyOverride

CAT = builtin_catalog()
W = Workload(1024, 128)


def write_profile(folder: Path, config: str, name: str, rows: list[tuple[int, float]]) -> None:
    (folder / config).mkdir(parents=True, exist_ok=True)
    (folder / config / name).write_text("tokens,ms\n" + "".join(f"{t},{ms}\n" for t, ms in rows))


def test_helix_layout_profile_drives_step_time_and_throughput(tmp_path: Path) -> None:
    write_profile(tmp_path, "1xL4", "decode_bs2time.csv", [(1, 2.0), (16, 2.5), (64, 4.0)])
    pm = MeasuredModel.from_folder(tmp_path)
    m, node = CAT.model("llama-2-70b"), CAT.node_config("1xL4")
    assert float(pm.step_time(m, Phase.DECODE, node, 4, 16, W)) == pytest.approx(4 * 2.5e-3)
    assert float(pm.step_time(m, Phase.DECODE, node, 2, 40, W)) == pytest.approx(2 * 3.25e-3)
    thr, batch = pm.throughput_table(m, Phase.DECODE, node, 0.1, 1, W)
    j = 4
    assert batch[j] > 0 and thr[j] == pytest.approx(batch[j] / (j * float(pm.profiles[("1xL4", Phase.DECODE)](batch[j]))))
    # no profile for prefill or other configs: roofline
    ref = RooflineModel()
    assert float(pm.step_time(m, Phase.PREFILL, node, 4, 512, W)) == float(ref.step_time(m, Phase.PREFILL, node, 4, 512, W))


def test_bad_profile_files(tmp_path: Path) -> None:
    write_profile(tmp_path, "1xL4", "decode_bs2time.csv", [(1, -2.0)])
    with pytest.raises(CoralInputError, match="positive"):
        MeasuredModel.from_folder(tmp_path)
    with pytest.raises(CoralInputError, match="no such profile folder"):
        MeasuredModel.from_folder(tmp_path / "missing")


def test_calibration_recovers_known_factors() -> None:
    m, node = CAT.model("qwen3-32b"), CAT.node_config("1xL40S")
    truth = EfficiencyOverride(compute_efficiency=0.4, memory_efficiency=0.7, step_overhead_ms=1.0)
    base = RooflineModel()
    true_pm = RooflineModel(base.params.model_copy(update={"gpu_overrides": {"L40S": truth}}))
    pts = []
    for layers, b in [(8, 1), (8, 64), (16, 256), (32, 16)]:
        pts.append((layers, b, float(true_pm.step_time(m, Phase.DECODE, node, layers, b, W))))
    for layers, b in [(8, 2048), (16, 8192)]:
        pts.append((layers, b, float(true_pm.step_time(m, Phase.PREFILL, node, layers, b, W))))
    decode_pts, prefill_pts = pts[:4], pts[4:]
    params, err = calibrate(base, m, Phase.DECODE, node, decode_pts, W)
    assert err < 1e-6
    got = params.gpu_overrides["L40S"]
    assert got.memory_efficiency == pytest.approx(0.7) and got.step_overhead_ms == pytest.approx(1.0)
    params, err = calibrate(base, m, Phase.PREFILL, node, prefill_pts, W)
    assert err < 0.01 and params.gpu_overrides["L40S"].compute_efficiency == pytest.approx(0.4, abs=0.051)
    assert np.isfinite(err)
