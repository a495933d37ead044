"""Roofline performance model: golden hand-computed cases and structural properties."""

from __future__ import annotations

import numpy as np
import pytest

from coral.catalog.loader import builtin_catalog
from coral.perf import Phase, RooflineModel, Workload
from coral.perf.roofline import bound_time

CAT = builtin_catalog()
PM = RooflineModel()
W = Workload(input_tokens=1024, output_tokens=128)


def test_bound_time_golden() -> None:
    """Compute 3 and memory 4: the roofline max is 4, the 2-norm blend 5, a large exponent tends to the max."""
    assert float(bound_time(3.0, 4.0, None)) == 4.0
    assert float(bound_time(3.0, 4.0, 2.0)) == pytest.approx(5.0)
    assert float(bound_time(3.0, 4.0, 64.0)) == pytest.approx(4.0, rel=1e-6)
    assert float(bound_time(0.0, 0.0, 2.0)) == 0.0


def test_prefill_step_matches_hand_roofline() -> None:
    """Large prefill on one H100: per layer the 2-norm (the shipped blend) of compute, 2 * active params * tokens
    (+ attention) / (TF * eff), and memory traffic, weights + the batch's KV / (bandwidth * eff); plus overhead."""
    m, node = CAT.model("llama-3-8b"), CAT.node_config("1xH100")
    sh = PM.shape(m)
    tokens = 8192
    t = float(PM.step_time(m, Phase.PREFILL, node, m.num_hidden_layers, tokens, W))
    heads_dim = m.num_attention_heads * sh.head_dim
    p = PM.params.for_gpu("H100")
    assert p.compute_memory_blend == 2.0
    flops = 2 * sh.active_params * tokens + 4 * tokens * (W.input_tokens / 2) * heads_dim
    compute = flops / (989e12 * p.compute_efficiency)
    memory = ((sh.attn_params + sh.dense_mlp_params) * 2 + tokens * sh.kv_bytes_per_token) / (
        node.gpu.mem_bw_gbs * 1e9 * p.memory_efficiency)
    expected = m.num_hidden_layers * (compute**2 + memory**2) ** 0.5 + p.step_overhead_ms / 1e3
    assert t == pytest.approx(expected, rel=1e-9)


def test_small_decode_is_bandwidth_bound() -> None:
    """Batch-1 decode streams the weights at the GPU's memory efficiency (blended with its tiny GEMM compute) and
    reads the KV cache at its (lower) attention efficiency."""
    m, node = CAT.model("llama-3-8b"), CAT.node_config("1xL4")
    sh = PM.shape(m)
    t = float(PM.step_time(m, Phase.DECODE, node, 10, 1, W))
    weight = (sh.attn_params + sh.dense_mlp_params) * 2
    kv = W.decode_context * sh.kv_bytes_per_token
    p = PM.params.for_gpu("L4")
    gemm = 2 * sh.active_params / (node.gpu.tflops * 1e12 * p.compute_efficiency)
    per_layer = (gemm**2 + (weight / (300e9 * p.memory_efficiency)) ** 2) ** 0.5 + kv / (300e9 * p.attention_efficiency)
    assert t == pytest.approx(10 * per_layer + p.step_overhead_ms / 1e3, rel=1e-9)


def test_decode_cost_per_sequence_grows_with_context() -> None:
    """The batch-dependent decode term: each extra sequence adds its KV read, more for longer contexts."""
    m, node = CAT.model("llama-2-70b"), CAT.node_config("1xA100-40G")
    short, long = Workload(256, 64), Workload(4096, 64)
    b = np.array([8.0, 16.0])
    slope_short = np.diff(PM.layer_time(m, Phase.DECODE, node, b, short))[0]
    slope_long = np.diff(PM.layer_time(m, Phase.DECODE, node, b, long))[0]
    kv_per_seq = PM.shape(m).kv_bytes_per_token * (long.decode_context - short.decode_context)
    p = PM.params.for_gpu("A100-40G")
    assert slope_long - slope_short == pytest.approx(8 * kv_per_seq / (1555e9 * p.attention_efficiency), rel=1e-9)


def test_per_gpu_efficiencies_and_fallbacks() -> None:
    """Fitted GPUs use their own factors; siblings without measurements borrow them; others use the top level."""
    p = PM.params
    assert p.for_gpu("A100-80G") == p.for_gpu("A100-40G")
    assert p.for_gpu("L4").compute_efficiency == p.gpu_overrides["L4"].compute_efficiency
    assert p.for_gpu("H100").compute_efficiency == p.compute_efficiency
    assert all(o.source for o in p.gpu_overrides.values()), "fitted values name their source"


def test_tensor_parallel_pays_allreduce_on_pcie_more_than_nvlink() -> None:
    m = CAT.model("qwen3-32b")
    pcie = CAT.node_config("4xL40S")
    t1 = float(PM.step_time(m, Phase.DECODE, CAT.node_config("1xL40S"), 8, 32, W))
    t4 = float(PM.step_time(m, Phase.DECODE, pcie, 8, 32, W))
    assert t4 > t1 / 4  # communication keeps TP from scaling perfectly


@pytest.mark.parametrize("config", ["1xL4", "2xL4", "1xL40S", "4xA10G", "1xH100", "8xA100-80G"])
@pytest.mark.parametrize("phase", [Phase.PREFILL, Phase.DECODE])
def test_throughput_table_properties(config: str, phase: Phase) -> None:
    m, node = CAT.model("qwen3-32b"), CAT.node_config(config)
    slo = 1.6 if phase is Phase.PREFILL else 0.1
    thr, batch = PM.throughput_table(m, phase, node, slo, 2, W)
    assert thr[0] == 0
    assert np.all(np.diff(thr[1:]) <= 1e-9), "more layers never give more throughput"
    fit = PM.max_layers(m, node, W)
    assert np.all(thr[fit + 1 :] == 0), "layers that do not fit give zero"
    ok = thr > 0
    if ok.any():
        frac = PM.params.prefill_budget_fraction if phase is Phase.PREFILL else PM.params.decode_budget_fraction
        j = np.flatnonzero(ok)
        t = PM.step_time(m, phase, node, j, batch[j], W, send_activations=True)
        assert np.all(t <= slo / 2 * frac + 1e-9), "the chosen batch meets the per-stage budget"


def test_moe_and_sliding_window_reduce_costs() -> None:
    oss = PM.shape(CAT.model("gpt-oss-120b"))
    assert oss.active_params < 0.1 * (oss.attn_params + 128 * oss.expert_params)
    assert oss.attended_tokens(100_000) < 0.6 * 100_000  # half the layers attend to 128 tokens
    assert float(oss.experts_touched(1)) == pytest.approx(4.0)
    assert float(oss.experts_touched(10_000)) == pytest.approx(128.0)


def test_layer_larger_than_the_node_fits_zero_layers() -> None:
    from coral.catalog.loader import model_from_hf_config

    huge = model_from_hf_config("huge", {"num_hidden_layers": 4, "hidden_size": 16384, "num_attention_heads": 128,
                                         "num_key_value_heads": 8, "intermediate_size": 200_000, "vocab_size": 32000})
    assert PM.max_layers(huge, CAT.node_config("1xT4"), W) == 0
    assert PM.max_layers(CAT.model("qwen3-235b"), CAT.node_config("1xT4"), W) == 2


def test_pipeline_keeps_stage_count_micro_batches_in_kv() -> None:
    """With S stages, S micro-batches are in flight, so the batch is capped at KV capacity / S."""
    m, node = CAT.model("qwen3-32b"), CAT.node_config("1xH100")
    cap, _, _ = PM.batch_limits(m, Phase.DECODE, node, W)
    for stages in (1, 2, 3):
        _, batch = PM.throughput_table(m, Phase.DECODE, node, 10.0, stages, W)  # loose SLO: memory binds
        j = 54
        assert batch[j] == min(np.floor(cap[j] / stages), PM.params.max_decode_batch)
