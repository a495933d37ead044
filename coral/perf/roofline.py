"""Analytic roofline performance model: prefill/decode step time of a node holding j layers.

Per-layer time: prefill = max(compute, memory traffic); decode = max(GEMM compute, weight streaming) + KV-cache
read by attention (its own bandwidth efficiency: the batch-dependent term); both plus the tensor-parallel
all-reduce. With `compute_memory_blend` q the max is replaced by the q-norm (see `bound_time`). Step time = layers x per-layer time + pipeline send + fixed overhead. Efficiencies are per GPU type
(`gpu_overrides`, fitted from measured profiles by `coral perf calibrate`; `gpu_fallbacks` borrow another GPU's).
Memory: weights of the held layers plus the KV cache must fit in `gpu_memory_utilization` of the GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from coral.catalog.loader import NodeConfig, data_path, load_file
from coral.catalog.schema import ModelArch, _Strict
from coral.perf.model import Phase, Workload

GB = 1e9


class EfficiencyOverride(_Strict):
    """Per-GPU values replacing the top-level ones; unset fields keep the top-level value."""

    compute_efficiency: float | None = Field(default=None, gt=0, le=1)
    memory_efficiency: float | None = Field(default=None, gt=0, le=1)
    attention_efficiency: float | None = Field(default=None, gt=0, le=1)
    interconnect_efficiency: float | None = Field(default=None, gt=0, le=1)
    step_overhead_ms: float | None = Field(default=None, ge=0)
    source: str | None = None


class PerfParams(_Strict):
    """Calibratable factors of the roofline model (see coral/data/perf_defaults.yaml)."""

    schema_version: Literal[1] = 1
    compute_efficiency: float = Field(gt=0, le=1)
    memory_efficiency: float = Field(gt=0, le=1)
    attention_efficiency: float = Field(gt=0, le=1)
    interconnect_efficiency: float = Field(gt=0, le=1)
    allreduce_latency_us: dict[Literal["nvlink", "pcie"], float]
    step_overhead_ms: float = Field(ge=0)
    gpu_memory_utilization: float = Field(gt=0, le=1)
    reserved_gb_per_gpu: float = Field(ge=0)
    min_kv_tokens: int = Field(gt=0)
    prefill_budget_fraction: float = Field(gt=0, le=1)
    decode_budget_fraction: float = Field(gt=0, le=1)
    max_prefill_batch_tokens: int = Field(gt=0)
    max_decode_batch: int = Field(gt=0)
    gpu_overrides: dict[str, EfficiencyOverride] = Field(default_factory=dict)
    gpu_fallbacks: dict[str, str] = Field(default_factory=dict)
    compute_memory_blend: float | None = Field(
        default=None, ge=1, description="None: a layer takes max(compute, memory) (the roofline); q: "
        "(compute^q + memory^q)^(1/q), slower than the max near the ridge point, where the two do not fully overlap")

    @model_validator(mode="after")
    def _fallbacks_resolve(self) -> PerfParams:
        for gpu, other in self.gpu_fallbacks.items():
            if other not in self.gpu_overrides:
                raise ValueError(f"gpu_fallbacks.{gpu}: {other!r} has no entry in gpu_overrides")
        return self

    def for_gpu(self, gpu: str) -> PerfParams:
        """These params with the GPU's own override applied (or that of its fallback GPU)."""
        o = self.gpu_overrides.get(gpu) or self.gpu_overrides.get(self.gpu_fallbacks.get(gpu, ""))
        if o is None:
            return self
        patch = {k: v for k, v in o.model_dump(exclude={"source"}).items() if v is not None}
        return self.model_copy(update=patch)

    def with_override(self, gpu: str, override: EfficiencyOverride) -> PerfParams:
        return self.model_copy(update={"gpu_overrides": {**self.gpu_overrides, gpu: override}})

    @classmethod
    def load(cls, path: str | Path | None = None) -> PerfParams:
        return load_file(cls, path or data_path("perf_defaults.yaml"))


def bound_time(compute: np.ndarray | float, memory: np.ndarray | float, blend: float | None) -> np.ndarray:
    """Time of work bounded by compute and memory traffic: max(compute, memory) without `blend`, else their
    `blend`-norm (compute^q + memory^q)^(1/q), which tends to the max as q grows."""
    c, m = np.asarray(compute, dtype=float), np.asarray(memory, dtype=float)
    top = np.maximum(c, m)
    if blend is None:
        return top
    safe = np.where(top > 0, top, 1.0)
    return np.where(top > 0, top * ((c / safe) ** blend + (m / safe) ** blend) ** (1.0 / blend), 0.0)


@dataclass(frozen=True)
class LayerShape:
    """Per-layer sizes of a model, derived from its architecture."""

    arch: ModelArch

    @cached_property
    def head_dim(self) -> int:
        a = self.arch
        return a.head_dim or a.hidden_size // a.num_attention_heads

    @cached_property
    def attn_params(self) -> float:
        a, hd = self.arch, self.head_dim
        q_out = a.num_attention_heads * hd
        kv_out = a.num_key_value_heads * hd
        return a.hidden_size * (q_out + 2 * kv_out) + q_out * a.hidden_size

    @cached_property
    def expert_params(self) -> float:
        a = self.arch
        return 3.0 * a.hidden_size * (a.moe_intermediate_size or 0)

    @cached_property
    def dense_mlp_params(self) -> float:
        a = self.arch
        if a.is_moe:
            return float(a.hidden_size * a.num_experts)  # router
        return 3.0 * a.hidden_size * a.intermediate_size

    @cached_property
    def weight_bytes_per_elem(self) -> float:
        return 2.0

    @cached_property
    def embedding_bytes_per_layer(self) -> float:
        a = self.arch
        tables = 1 if a.tie_word_embeddings else 2
        return tables * a.vocab_size * a.hidden_size * 2.0 / a.num_hidden_layers

    @cached_property
    def expert_bytes(self) -> float:
        return self.expert_params * self.arch.expert_weight_bits / 8.0

    @cached_property
    def layer_bytes(self) -> float:
        """Resident weight bytes of one layer (all experts), with embeddings spread over layers."""
        a = self.arch
        experts = a.num_experts * self.expert_bytes
        return (self.attn_params + self.dense_mlp_params) * 2.0 + experts + self.embedding_bytes_per_layer

    @cached_property
    def active_params(self) -> float:
        a = self.arch
        return self.attn_params + self.dense_mlp_params + a.num_experts_per_tok * self.expert_params

    @cached_property
    def kv_bytes_per_token(self) -> float:
        a = self.arch
        return 2.0 * a.num_key_value_heads * self.head_dim * 2.0

    @cached_property
    def sliding_fraction(self) -> float:
        a = self.arch
        if not a.layer_types:
            return 0.0
        return a.layer_types.count("sliding_attention") / len(a.layer_types)

    def attended_tokens(self, context: np.ndarray | float) -> np.ndarray | float:
        """Mean tokens a layer's attention holds or reads for a given context, across full/sliding layers."""
        w = self.arch.sliding_window
        if w is None or self.sliding_fraction == 0.0:
            return context
        f = self.sliding_fraction
        return (1 - f) * context + f * np.minimum(context, w)

    def experts_touched(self, tokens: np.ndarray | float) -> np.ndarray | float:
        a = self.arch
        if not a.is_moe:
            return 0.0
        e, k = a.num_experts, a.num_experts_per_tok
        return e * (1.0 - (1.0 - k / e) ** np.maximum(tokens, 0.0))

    @property
    def model_bytes(self) -> float:
        return self.layer_bytes * self.arch.num_hidden_layers


class RooflineModel:
    """The analytic performance model; every figure is per node (TP across its GPUs)."""

    def __init__(self, params: PerfParams | None = None) -> None:
        self.params = params or PerfParams.load()
        self._shapes: dict[str, LayerShape] = {}

    def shape(self, model: ModelArch) -> LayerShape:
        s = self._shapes.get(model.name)
        if s is None or s.arch != model:
            s = self._shapes[model.name] = LayerShape(model)
        return s

    # --- memory -------------------------------------------------------------------------------------
    def usable_bytes(self, node: NodeConfig) -> float:
        p = self.params
        per_gpu = node.gpu.memory_gb * p.gpu_memory_utilization - p.reserved_gb_per_gpu
        return max(per_gpu, 0.0) * GB * node.count

    def kv_capacity_tokens(self, model: ModelArch, node: NodeConfig, layers: np.ndarray | int) -> np.ndarray:
        """KV-cache tokens (of full-attention context) that fit beside `layers` layers of weights."""
        sh = self.shape(model)
        j = np.asarray(layers, dtype=float)
        free = self.usable_bytes(node) - j * sh.layer_bytes
        per_token = np.maximum(j, 1.0) * sh.kv_bytes_per_token
        return np.where(j > 0, np.maximum(free, 0.0) / per_token, 0.0)

    def max_layers(self, model: ModelArch, node: NodeConfig, workload: Workload | None = None) -> int:
        sh = self.shape(model)
        p = self.params
        per_layer = sh.layer_bytes + p.min_kv_tokens * sh.kv_bytes_per_token
        return int(min(model.num_hidden_layers, self.usable_bytes(node) // per_layer))

    # --- time ---------------------------------------------------------------------------------------
    def _allreduce_s(self, node: NodeConfig, nbytes: np.ndarray, p: PerfParams) -> np.ndarray:
        g = node.count
        if g == 1:
            return np.zeros_like(nbytes)
        bw = node.gpu.intra_node_bw_gbs * GB * p.interconnect_efficiency
        lat = p.allreduce_latency_us[node.gpu.interconnect] * 1e-6
        return 2.0 * (g - 1) / g * nbytes / bw + 2.0 * (g - 1) * lat

    def layer_time(
        self,
        model: ModelArch,
        phase: Phase,
        node: NodeConfig,
        batch: np.ndarray | float,
        workload: Workload,
        params: PerfParams | None = None,
    ) -> np.ndarray:
        """Seconds one layer takes for `batch` prompt tokens (prefill) or sequences (decode), all-reduce included;
        `params` (default: this model's, with the GPU's override) lets calibration try other values."""
        sh = self.shape(model)
        p = params or self.params.for_gpu(node.gpu.name)
        tokens = np.asarray(batch, dtype=float)
        heads_dim = model.num_attention_heads * sh.head_dim
        g = node.count
        peak_flops = g * node.gpu.tflops * 1e12 * p.compute_efficiency
        bandwidth = g * node.gpu.mem_bw_gbs * GB
        dense_bytes = (sh.attn_params + sh.dense_mlp_params) * 2.0
        weight_bytes = dense_bytes + sh.experts_touched(tokens) * sh.expert_bytes
        gemm_flops = 2.0 * sh.active_params * tokens
        if phase is Phase.PREFILL:
            attn_ctx = sh.attended_tokens(workload.input_tokens / 2.0)
            compute = (gemm_flops + 4.0 * tokens * attn_ctx * heads_dim) / peak_flops
            memory = (weight_bytes + tokens * sh.kv_bytes_per_token) / (bandwidth * p.memory_efficiency)
            core = bound_time(compute, memory, p.compute_memory_blend)
        else:
            kv_read = tokens * sh.attended_tokens(workload.decode_context) * sh.kv_bytes_per_token
            dense = bound_time(gemm_flops / peak_flops, weight_bytes / (bandwidth * p.memory_efficiency),
                               p.compute_memory_blend)
            core = dense + kv_read / (bandwidth * p.attention_efficiency)
        comm = 2.0 * self._allreduce_s(node, tokens * model.hidden_size * 2.0, p)
        return np.asarray(core + comm)

    def send_time(self, model: ModelArch, node: NodeConfig, batch: np.ndarray | float) -> np.ndarray:
        """Seconds to send a batch's activations to the next pipeline stage over the node's NIC (top-level
        interconnect efficiency: the per-GPU values describe the intra-node all-reduce)."""
        nic = node.nic_gbps * GB / 8 * self.params.interconnect_efficiency
        return np.asarray(batch, dtype=float) * model.hidden_size * 2.0 / nic

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
        """Seconds for one step of `batch` prompt tokens (prefill) or sequences (decode) over `layers` layers."""
        p = self.params.for_gpu(node.gpu.name)
        j = np.asarray(layers, dtype=float)
        t = j * self.layer_time(model, phase, node, batch, workload) + p.step_overhead_ms * 1e-3
        if send_activations:
            t = t + self.send_time(model, node, batch)
        return np.asarray(t)

    # --- throughput under a latency budget ----------------------------------------------------------
    def batch_limits(
        self, model: ModelArch, phase: Phase, node: NodeConfig, workload: Workload
    ) -> tuple[np.ndarray, float, float]:
        """(memory batch cap per j, min useful batch, configured batch cap) for j = 0..L."""
        sh = self.shape(model)
        p = self.params
        j = np.arange(model.num_hidden_layers + 1)
        kv_tokens = self.kv_capacity_tokens(model, node, j)
        fits = j <= self.max_layers(model, node, workload)
        if phase is Phase.PREFILL:
            per_token = sh.attended_tokens(workload.input_tokens) / workload.input_tokens
            cap_mem = kv_tokens / per_token
            return np.where(fits, cap_mem, 0.0), workload.input_tokens, float(p.max_prefill_batch_tokens)
        per_seq = sh.attended_tokens(workload.max_context)
        cap_mem = np.floor(kv_tokens / per_seq)
        return np.where(fits, cap_mem, 0.0), 1.0, float(p.max_decode_batch)

    def throughput_table(
        self,
        model: ModelArch,
        phase: Phase,
        node: NodeConfig,
        slo_s: float,
        stages: int,
        workload: Workload,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(tokens/s, batch) for j = 0..L when each of `stages` stages gets slo_s/stages per step; the batch
        is per micro-batch, and `stages` micro-batches must fit in the KV cache together."""
        p = self.params
        frac = p.prefill_budget_fraction if phase is Phase.PREFILL else p.decode_budget_fraction
        budget = slo_s / stages * frac
        cap_mem, lo_batch, cap_cfg = self.batch_limits(model, phase, node, workload)
        j = np.arange(model.num_hidden_layers + 1)
        # A full pipeline keeps `stages` micro-batches in flight, each holding KV on every stage node.
        in_flight = cap_mem / stages if phase is Phase.PREFILL else np.floor(cap_mem / stages)
        hi = np.minimum(in_flight, cap_cfg)
        send = stages > 1

        def fits(batch: np.ndarray) -> np.ndarray:
            return self.step_time(model, phase, node, j, batch, workload, send) <= budget

        ok = (j > 0) & (hi >= lo_batch) & fits(np.full(j.shape, lo_batch))
        lo = np.full(j.shape, lo_batch)
        top = np.maximum(hi, lo_batch)
        done = ~ok | fits(top)
        lo = np.where(done & ok, top, lo)
        up = top.copy()
        for _ in range(40):
            mid = (lo + up) / 2
            good = fits(mid)
            lo = np.where(~done & good, mid, lo)
            up = np.where(~done & ~good, mid, up)
        if phase is Phase.DECODE:
            lo = np.floor(lo)
        t = self.step_time(model, phase, node, j, lo, workload, send)
        thr = np.where(ok, lo / np.where(t > 0, t, 1.0), 0.0)
        thr[1:] = np.minimum.accumulate(thr[1:])  # monotone envelope: more layers never give more throughput
        return thr, np.where(thr > 0, lo, 0.0)
