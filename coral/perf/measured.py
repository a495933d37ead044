"""Measured profiles (per-layer batch -> time tables) and calibration of the roofline's efficiency factors.

Profile folder layout, as Helix ships it: ``<dir>/<config>/prompt_bs2time.csv`` and ``decode_bs2time.csv``
with a header ``tokens,ms``: the time in milliseconds one layer takes for a batch of that many tokens on a
node of that config (e.g. ``<dir>/1xL4/decode_bs2time.csv``). Configs without files use the roofline.
"""

from __future__ import annotations

import csv
import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coral.catalog.loader import CoralInputError, NodeConfig
from coral.catalog.schema import ModelArch
from coral.perf.model import Phase, Workload
from coral.perf.roofline import EfficiencyOverride, PerfParams, RooflineModel

PROFILE_FILES = {Phase.PREFILL: "prompt_bs2time.csv", Phase.DECODE: "decode_bs2time.csv"}


@dataclass(frozen=True)
class LayerProfile:
    """Per-layer time (s) against batch tokens, linearly interpolated (extrapolated from the last two points)."""

    tokens: np.ndarray
    seconds: np.ndarray

    def __call__(self, batch: np.ndarray | float) -> np.ndarray:
        b = np.asarray(batch, dtype=float)
        t = np.interp(b, self.tokens, self.seconds)
        if len(self.tokens) >= 2:
            slope = (self.seconds[-1] - self.seconds[-2]) / (self.tokens[-1] - self.tokens[-2])
            t = np.where(b > self.tokens[-1], self.seconds[-1] + slope * (b - self.tokens[-1]), t)
        return t


def read_layer_profile(path: Path) -> LayerProfile:
    try:
        with path.open() as f:
            rows = list(csv.DictReader(f))
    except OSError as exc:
        raise CoralInputError(f"{path}: cannot read: {exc.strerror}") from exc
    if not rows or not {"tokens", "ms"} <= set(rows[0]):
        raise CoralInputError(f"{path}: expected a header 'tokens,ms'")
    try:
        pts = sorted((float(r["tokens"]), float(r["ms"]) / 1e3) for r in rows)
    except ValueError as exc:
        raise CoralInputError(f"{path}: non-numeric value ({exc})") from exc
    tokens = np.array([p[0] for p in pts])
    seconds = np.array([p[1] for p in pts])
    if (tokens <= 0).any() or (seconds <= 0).any() or len(np.unique(tokens)) != len(tokens):
        raise CoralInputError(f"{path}: tokens and ms must be positive and tokens unique")
    return LayerProfile(tokens, seconds)


class MeasuredModel(RooflineModel):
    """Step times from measured per-layer profiles where present; memory limits and the rest from the roofline."""

    def __init__(self, profiles: dict[tuple[str, Phase], LayerProfile], params: PerfParams | None = None) -> None:
        super().__init__(params)
        self.profiles = profiles

    @classmethod
    def from_folder(cls, folder: str | Path, params: PerfParams | None = None) -> MeasuredModel:
        folder = Path(folder)
        if not folder.is_dir():
            raise CoralInputError(f"{folder}: no such profile folder")
        profiles = {}
        for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
            for phase, name in PROFILE_FILES.items():
                if (sub / name).exists():
                    profiles[(sub.name, phase)] = read_layer_profile(sub / name)
        if not profiles:
            raise CoralInputError(f"{folder}: no <config>/prompt_bs2time.csv or decode_bs2time.csv found")
        return cls(profiles, params)

    def step_time(
        self,
        model: ModelArch,
        phase: Phase,
        node: NodeConfig,
        layers: np.ndarray | int,
        batch: np.ndarray | float,
        workload: Workload,
        send_activations: bool = False,
    ) -> np.ndarray:
        prof = self.profiles.get((node.name, phase))
        if prof is None:
            return super().step_time(model, phase, node, layers, batch, workload, send_activations)
        t = np.asarray(layers, dtype=float) * prof(batch)
        if send_activations:
            p = self.params
            t = t + np.asarray(batch) * model.hidden_size * 2.0 / (node.nic_gbps * 1e9 / 8 * p.interconnect_efficiency)
        return np.asarray(t)


def calibrate(
    perf: RooflineModel,
    model: ModelArch,
    phase: Phase,
    node: NodeConfig,
    points: list[tuple[int, float, float]],
    workload: Workload,
) -> tuple[PerfParams, float]:
    """Fit the GPU's compute/memory efficiency and step overhead to measured (layers, batch, seconds) points by
    minimising the mean squared relative error over a grid; returns updated params and the fitted error."""
    if not points:
        raise CoralInputError("calibrate: no measured points")
    layers = np.array([p[0] for p in points], dtype=float)
    batch = np.array([p[1] for p in points], dtype=float)
    seconds = np.array([p[2] for p in points], dtype=float)
    best: tuple[float, EfficiencyOverride] | None = None
    grid_eff = np.linspace(0.2, 1.0, 17)
    grid_over = np.array([0.0, 0.5, 1.0, 2.0, 3.0, 5.0, 8.0])
    for ce, me, ov in itertools.product(grid_eff, grid_eff, grid_over):
        o = EfficiencyOverride(compute_efficiency=float(ce), memory_efficiency=float(me), step_overhead_ms=float(ov))
        trial = RooflineModel(perf.params.model_copy(update={"gpu_overrides": {
            **perf.params.gpu_overrides, node.gpu.name: o}}))
        pred = trial.step_time(model, phase, node, layers, batch, workload)
        err = float(np.mean(((pred - seconds) / seconds) ** 2))
        if best is None or err < best[0]:
            best = (err, o)
    assert best is not None
    params = perf.params.model_copy(update={"gpu_overrides": {**perf.params.gpu_overrides, node.gpu.name: best[1]}})
    return params, float(np.sqrt(best[0]))
