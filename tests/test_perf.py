"""Roofline performance model: golden hand-computed cases and structural properties."""

from __future__ import annotations

import numpy as np
import pytest

from coral.catalog.loader import builtin_catalog
from coral.perf import Phase, RooflineModel, Workload

CAT = builtin_catalog()
PM = RooflineModel()
W = Workload(input_tokens=1024, output_tokens=128)


def test_prefill_step_matches_hand_roofline() -> None:
    """Large prefill on one H100 is compute bound: t = 2 * active params * tokens / (TF * eff) + overhead."""
    m, node = CAT.model("llama-3-8b"), CAT.node_config("1xH100")
    sh = PM.shape(m)
    tokens = 8192
    t = float(PM.step_time(m, Phase.PREFILL, node, m.num_hidden_layers, tokens, W))
    heads_dim = m.num_attention_heads * sh.head_dim
    flops = m.num_hidden_layers * (2 * sh.active_params * tokens + 4 * tokens * (W.input_tokens / 2) * heads_dim)
    p = PM.params
    expected = flops / (989e12 * p.compute_efficiency) + p.step_overhead_ms / 1e3
    assert t == pytest.approx(expected, rel=1e-9)


def test_small_decode_is_bandwidth_bound() -> None:
    m, node = CAT.model("llama-3-8b"), CAT.node_config("1xL4")
    sh = PM.shape(m)
    t = float(PM.step_time(m, Phase.DECODE, node, 10, 1, W))
    weight = (sh.attn_params + sh.dense_mlp_params) * 2
    kv = W.decode_context * sh.kv_bytes_per_token
    expected = 10 * (weight + kv) / (300e9 * PM.params.memory_efficiency) + PM.params.step_overhead_ms / 1e3
    assert t == pytest.approx(expected, rel=1e-9)


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
