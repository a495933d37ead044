"""Step-time lookup tables of the perf model for every (model, phase, node config, layers, stages) a plan uses,
so the event loop never calls the perf model."""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass

import numpy as np

from coral.catalog.loader import Catalog
from coral.catalog.schema import Scenario
from coral.perf.model import Phase, Workload
from coral.perf.roofline import RooflineModel


@dataclass(frozen=True)
class NodeKernel:
    """What the simulator needs of one stage node.

    Prefill: `table[x]` is the step time (s) for x prompt tokens. Decode: `ctx_table[k * len(CTX_GRID) + g]` is
    the step time with k sequences resident on the node (with S pipeline stages a step runs a micro-batch of
    ceil(k/S) of them) whose mean context is CTX_GRID[g]; `decode_step` interpolates between grid points. `cap`
    is the largest x or k the runtime lets in: the template's planned batch (x S micro-batches for decode),
    which keeps steps within the SLO budget the template was sized for.
    """

    table: list[float]
    ctx_table: array[float]
    cap: int
    kv_tokens: float
    nic_bytes_s: float
    gpus: int


#: decode contexts (tokens) the step-time tables are sampled at: two points per octave, 1 .. 2^20
CTX_GRID = [2.0 ** (g / 2) for g in range(41)]
_G = len(CTX_GRID)


def decode_step(ctx_table: array[float], k: int, mean_ctx: float) -> float:
    """Step time at k resident sequences of mean context `mean_ctx`, linear between grid contexts."""
    if mean_ctx <= 1.0:
        return ctx_table[k * _G]
    g = min(int(2.0 * math.log2(mean_ctx)), _G - 2)
    lo, hi = CTX_GRID[g], CTX_GRID[g + 1]
    base = k * _G + g
    a = ctx_table[base]
    return a + (ctx_table[base + 1] - a) * (mean_ctx - lo) / (hi - lo)


@dataclass(frozen=True)
class ModelConstants:
    """Per-model figures the simulator uses: SLOs, workload means and KV sizes."""

    workload: Workload
    kv_bytes_per_token_layer: float
    ttft_slo_s: float
    tpot_slo_s: float


class KernelCache:
    """Builds and memoises NodeKernels for one scenario, catalog and perf model."""

    def __init__(self, scenario: Scenario, catalog: Catalog, perf: RooflineModel) -> None:
        self.scenario, self.catalog, self.perf = scenario, catalog, perf
        self._cache: dict[tuple[str, str, str, int, int, Workload], NodeKernel] = {}
        self.models: dict[str, ModelConstants] = {}
        for m in scenario.models:
            arch = catalog.model(m.model)
            self.models[m.model] = ModelConstants(
                workload=Workload(m.mean_input_tokens, m.mean_output_tokens),
                kv_bytes_per_token_layer=perf.shape(arch).kv_bytes_per_token,
                ttft_slo_s=m.prefill_slo_ms / 1e3,
                tpot_slo_s=m.decode_slo_ms / 1e3,
            )

    def attended(self, model: str, tokens: np.ndarray) -> np.ndarray:
        """KV tokens per layer a context of `tokens` holds (sliding-window layers hold at most the window)."""
        shape = self.perf.shape(self.catalog.model(model))
        return np.asarray(shape.attended_tokens(np.asarray(tokens, dtype=float)), dtype=float)

    def kernel(self, model: str, phase: str, config: str, layers: int, n_stages: int,
               workload: Workload | None = None) -> NodeKernel:
        """The kernel of one stage node; its batch cap is sized for `workload` (default: the model's means; an
        instance planned for some request classes only: their mix)."""
        key = (model, phase, config, layers, n_stages, workload or self.models[model].workload)
        k = self._cache.get(key)
        if k is None:
            k = self._cache[key] = self._build(*key)
        return k

    def _build(self, model: str, phase_name: str, config: str, layers: int, n_stages: int,
               w: Workload) -> NodeKernel:
        consts = self.models[model]
        arch = self.catalog.model(model)
        node = self.catalog.node_config(config)
        phase = Phase(phase_name)
        perf = self.perf
        slo = consts.ttft_slo_s if phase is Phase.PREFILL else consts.tpot_slo_s
        _, batch = perf.throughput_table(arch, phase, node, slo, n_stages, w)
        planned = float(batch[min(layers, len(batch) - 1)])
        send = n_stages > 1
        table: list[float] = []
        ctx_table = array("d")
        if phase is Phase.PREFILL:
            cap = max(int(planned), 1) if planned > 0 else max(int(w.input_tokens), 1)
            x = np.arange(cap + 1, dtype=float)
            table = np.asarray(perf.step_time(arch, phase, node, layers, x, w, send), dtype=float).tolist()
        else:
            cap = max(int(planned), 1) * n_stages
            micro = np.ceil(np.arange(cap + 1, dtype=float) / n_stages)
            rows = np.empty((cap + 1, _G))
            for g, ctx in enumerate(CTX_GRID):  # Workload(ctx, 0) has decode context ctx
                rows[:, g] = perf.step_time(arch, phase, node, layers, micro, Workload(ctx, 0.0), send)
            ctx_table = array("d", rows.ravel().tolist())
        kv = float(perf.kv_capacity_tokens(arch, node, layers))
        return NodeKernel(
            table=table,
            ctx_table=ctx_table,
            cap=cap,
            kv_tokens=kv if math.isfinite(kv) else 0.0,
            nic_bytes_s=node.nic_bytes_s,
            gpus=node.count,
        )
