"""Measured per-layer profiles (Helix layout) and calibration of the roofline's per-GPU efficiency factors.

Profile folder layout, as Helix publishes it (`Thesys-lab/Helix-ASPLOS25`, `simulator/model_manager/<model>/`):
``<dir>/<folder>/prompt_bs2time.csv`` and ``decode_bs2time.csv``, rows ``batch,ms`` without a header (a header
line such as ``tokens,ms``, as `coral perf profile` writes, is accepted too): the milliseconds one layer takes on
the whole node (tensor parallel over its GPUs) for a batch of that many prompt tokens or decode sequences. Rows
with batch 0 (Helix starts every file with ``0,0``) are skipped. Folder names are coral configs (``2xL4``) or
Helix names (``a100``, ``l4x2``, ``t4x4``); an optional ``<dir>/profile.yaml`` maps folders to configs and
names the model and the workload the profiles were measured with.
"""

from __future__ import annotations

import csv
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import Field

from coral.catalog.loader import Catalog, CoralInputError, NodeConfig, builtin_catalog, load_file
from coral.catalog.schema import ModelArch, _Strict, parse_config_name
from coral.perf.model import Phase, Workload
from coral.perf.roofline import EfficiencyOverride, PerfParams, RooflineModel

PROFILE_FILES = {Phase.PREFILL: "prompt_bs2time.csv", Phase.DECODE: "decode_bs2time.csv"}
MANIFEST = "profile.yaml"
EFFICIENCY_BOUNDS = (0.02, 1.0)


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

    def subset(self, keep: np.ndarray) -> LayerProfile:
        return LayerProfile(self.tokens[keep], self.seconds[keep])


def read_layer_profile(path: Path) -> LayerProfile:
    """Read one ``batch,ms`` file (optional header, batch-0 rows skipped)."""
    try:
        with path.open() as f:
            rows = [r for r in csv.reader(f) if r and any(c.strip() for c in r)]
    except OSError as exc:
        raise CoralInputError(f"{path}: cannot read: {exc.strerror}") from exc
    if rows and not _is_number(rows[0][0]):
        rows = rows[1:]  # header line
    pts = []
    for n, row in enumerate(rows, 1):
        if len(row) != 2 or not all(_is_number(c) for c in row):
            raise CoralInputError(f"{path}: row {n}: expected 'batch,ms' with two numbers, got {','.join(row)!r}")
        pts.append((float(row[0]), float(row[1]) / 1e3))
    pts = sorted(p for p in pts if p[0] != 0)
    if not pts:
        raise CoralInputError(f"{path}: no rows with a non-zero batch")
    tokens = np.array([p[0] for p in pts])
    seconds = np.array([p[1] for p in pts])
    if (tokens <= 0).any() or (seconds <= 0).any() or len(np.unique(tokens)) != len(tokens):
        raise CoralInputError(f"{path}: batch and ms must be positive and each batch listed once")
    return LayerProfile(tokens, seconds)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class ProfileManifest(_Strict):
    """Optional ``profile.yaml`` of a profile folder: what was measured, and folder -> config names."""

    model: str | None = None
    input_tokens: float | None = Field(default=None, gt=0)
    output_tokens: float | None = Field(default=None, gt=0)
    configs: dict[str, str] = Field(default_factory=dict)
    source: str | None = None

    @property
    def workload(self) -> Workload | None:
        if self.input_tokens is None or self.output_tokens is None:
            return None
        return Workload(self.input_tokens, self.output_tokens)


_HELIX_FOLDER = re.compile(r"^(?P<gpu>[a-z0-9\-]+?)(?:x(?P<count>\d+))?$")


def infer_config(folder: str, catalog: Catalog) -> str:
    """Coral config of a profile folder name: ``2xL4`` as is, Helix's ``l4x2`` -> ``2xL4``, ``a100`` -> ``1x<the
    one catalog GPU named A100 or A100-*>``."""
    try:
        parse_config_name(folder)
        return folder
    except ValueError:
        pass
    m = _HELIX_FOLDER.match(folder.lower())
    if m is None:
        raise CoralInputError(f"profile folder {folder!r}: not a config name (2xL4) or a Helix name (l4x2)")
    token = m["gpu"]
    gpus = [g for g in catalog.gpus if g.lower() == token or g.lower().startswith(token + "-")]
    if len(gpus) != 1:
        found = f"matches {', '.join(gpus)}" if gpus else "matches no catalog GPU"
        raise CoralInputError(f"profile folder {folder!r}: GPU {token!r} {found}; map the folder to a config in "
                              f"{MANIFEST} (configs:) or with --map {folder}=<config>")
    return f"{m['count'] or 1}x{gpus[0]}"


@dataclass(frozen=True)
class ProfileSet:
    """Per-layer profiles keyed by (coral config, phase), with what the folder's manifest says about them."""

    profiles: dict[tuple[str, Phase], LayerProfile]
    manifest: ProfileManifest

    @classmethod
    def read(cls, folder: str | Path, configs: dict[str, str] | None = None,
             catalog: Catalog | None = None) -> ProfileSet:
        """Read a profile folder; `configs` (folder -> config) adds to or overrides the manifest's mapping."""
        folder = Path(folder)
        if not folder.is_dir():
            raise CoralInputError(f"{folder}: no such profile folder")
        manifest = load_file(ProfileManifest, folder / MANIFEST) if (folder / MANIFEST).exists() else ProfileManifest()
        mapping = {**manifest.configs, **(configs or {})}
        cat = catalog or builtin_catalog()
        profiles: dict[tuple[str, Phase], LayerProfile] = {}
        for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
            files = {ph: sub / name for ph, name in PROFILE_FILES.items() if (sub / name).exists()}
            if not files:
                continue
            config = mapping.get(sub.name) or infer_config(sub.name, cat)
            cat.node_config(config)  # unknown GPU: clear error now
            for phase, path in files.items():
                if (config, phase) in profiles:
                    raise CoralInputError(f"{path}: a second {phase} profile for {config}")
                profiles[(config, phase)] = read_layer_profile(path)
        if not profiles:
            raise CoralInputError(f"{folder}: no <config>/prompt_bs2time.csv or decode_bs2time.csv found")
        return cls(profiles, manifest.model_copy(update={"configs": mapping}))

    def subset(self, keep: dict[tuple[str, Phase], np.ndarray]) -> ProfileSet:
        return ProfileSet({k: p.subset(keep[k]) for k, p in self.profiles.items()}, self.manifest)


class MeasuredModel(RooflineModel):
    """Step times from measured per-layer profiles where present; memory limits and the rest from the roofline."""

    def __init__(self, profiles: dict[tuple[str, Phase], LayerProfile], params: PerfParams | None = None) -> None:
        super().__init__(params)
        self.profiles = profiles

    @classmethod
    def from_folder(cls, folder: str | Path, params: PerfParams | None = None,
                    configs: dict[str, str] | None = None) -> MeasuredModel:
        return cls(ProfileSet.read(folder, configs).profiles, params)

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
            t = t + self.send_time(model, node, batch)
        return np.asarray(t)


# --- calibration ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuFit:
    """Fitted efficiencies of one GPU type, and which of them ended at a bound of EFFICIENCY_BOUNDS."""

    gpu: str
    override: EfficiencyOverride
    fitted: tuple[str, ...]
    at_bounds: tuple[str, ...]
    rms_log_error: float


def relative_errors(
    perf: RooflineModel, model: ModelArch, profiles: ProfileSet, workload: Workload, catalog: Catalog | None = None
) -> dict[tuple[str, Phase], np.ndarray]:
    """predicted / measured - 1 at every measured row, per (config, phase)."""
    cat = catalog or builtin_catalog()
    return {(config, phase): perf.layer_time(model, phase, cat.node_config(config), prof.tokens, workload)
            / prof.seconds - 1.0 for (config, phase), prof in profiles.profiles.items()}


def error_summary(errors: np.ndarray) -> tuple[float, float]:
    """(median, worst) absolute relative error."""
    a = np.abs(errors)
    return float(np.median(a)), float(a.max())


def _parameters_to_fit(keys: Iterable[tuple[NodeConfig, Phase]]) -> tuple[str, ...]:
    """What the measurements constrain: prefill -> compute; decode -> weight and KV bandwidth; TP -> all-reduce."""
    keys = list(keys)
    names = []
    if any(ph is Phase.PREFILL for _, ph in keys):
        names.append("compute_efficiency")
    if any(ph is Phase.DECODE for _, ph in keys):
        names += ["memory_efficiency", "attention_efficiency"]
    if any(node.count > 1 for node, _ in keys):
        names.append("interconnect_efficiency")
    return tuple(names)


def _coordinate_search(objective: _Objective, start: dict[str, float], sweeps: int = 8) -> dict[str, float]:
    """Minimise over each efficiency in turn on a log grid within EFFICIENCY_BOUNDS, zooming in twice."""
    lo, hi = np.log(EFFICIENCY_BOUNDS[0]), np.log(EFFICIENCY_BOUNDS[1])
    x = {k: float(np.clip(v, *EFFICIENCY_BOUNDS)) for k, v in start.items()}
    for _ in range(sweeps):
        before = dict(x)
        for name in x:
            a, b = lo, hi
            for _zoom in range(3):
                grid = np.exp(np.linspace(a, b, 25))
                scores = [objective({**x, name: float(v)}) for v in grid]
                i = int(np.argmin(scores))
                x[name] = float(grid[i])
                step = (b - a) / 24
                a, b = max(lo, np.log(grid[i]) - step), min(hi, np.log(grid[i]) + step)
        if all(abs(np.log(x[k] / before[k])) < 1e-4 for k in x):
            break
    return x


class _Objective:
    """Mean over (config, phase) of the mean squared log ratio predicted / measured, for one GPU type."""

    def __init__(self, perf: RooflineModel, model: ModelArch, data: list[tuple[NodeConfig, Phase, LayerProfile]],
                 workload: Workload, base: PerfParams) -> None:
        self.perf, self.model, self.data, self.workload, self.base = perf, model, data, workload, base

    def __call__(self, values: dict[str, float]) -> float:
        p = self.base.model_copy(update=values)
        errs = [np.mean(np.log(self.perf.layer_time(self.model, ph, node, prof.tokens, self.workload, p)
                               / prof.seconds) ** 2) for node, ph, prof in self.data]
        return float(np.mean(errs))


def calibrate(
    perf: RooflineModel,
    model: ModelArch,
    profiles: ProfileSet,
    workload: Workload,
    source: str,
    catalog: Catalog | None = None,
) -> tuple[PerfParams, list[GpuFit]]:
    """Fit each measured GPU type's efficiencies (compute, weight bandwidth, decode KV bandwidth, all-reduce: those
    its profiles constrain) to the per-layer profiles, minimising the mean squared log error of predicted vs
    measured per-layer times. Returns `perf.params` with the fitted `gpu_overrides` (labelled `source`)."""
    cat = catalog or builtin_catalog()
    by_gpu: dict[str, list[tuple[NodeConfig, Phase, LayerProfile]]] = defaultdict(list)
    for (config, phase), prof in sorted(profiles.profiles.items()):
        node = cat.node_config(config)
        by_gpu[node.gpu.name].append((node, phase, prof))
    params, fits = perf.params, []
    for gpu, data in by_gpu.items():
        base = params.for_gpu(gpu)
        names = _parameters_to_fit((node, ph) for node, ph, _ in data)
        objective = _Objective(perf, model, data, workload, base)
        x = _coordinate_search(objective, {k: getattr(base, k) for k in names})
        at_bounds = tuple(k for k, v in x.items()
                          if v <= EFFICIENCY_BOUNDS[0] * 1.02 or v >= EFFICIENCY_BOUNDS[1] / 1.02)
        old = params.gpu_overrides.get(gpu) or EfficiencyOverride()
        override = old.model_copy(update={**{k: round(v, 3) for k, v in x.items()}, "source": source})
        params = params.with_override(gpu, override)
        fits.append(GpuFit(gpu, override, names, at_bounds, float(np.sqrt(objective(x)))))
    return params, fits
