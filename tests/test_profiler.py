"""The vLLM profiler end to end against a batching stand-in engine on loopback (real HTTP, real processes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from coral.perf import Phase
from coral.perf.measured import read_layer_profile
from coral.perf.profiler import ProfileSpec, profile, subprocess_launcher, vllm_command

FAKE = Path(__file__).with_name("fake_vllm.py")


def test_vllm_command_truncates_layers_and_uses_dummy_weights() -> None:
    spec = ProfileSpec("Qwen/Qwen3-32B", "2xL40S", tensor_parallel=2)
    cmd = vllm_command(spec, 4, 8123)
    assert cmd[:3] == ["vllm", "serve", "Qwen/Qwen3-32B"]
    assert cmd[cmd.index("--hf-overrides") + 1] == '{"num_hidden_layers": 4}'
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--load-format") + 1] == "dummy"


def test_profile_recovers_per_layer_costs(tmp_path: Path) -> None:
    spec = ProfileSpec("fake", "1xL4", 1, layer_counts=(4, 16), prefill_tokens=(512, 4096),
                       decode_batches=(1, 8), prompt_tokens=512, decode_steps=10)
    launcher = subprocess_launcher(spec, f"{sys.executable} {FAKE} --layers {{layers}} --port {{port}}", 60)
    rows = profile(spec, launcher, tmp_path)
    truth_prefill = {b: 1.0 + 0.004 * b for b in (512, 4096)}
    truth_decode = {b: 2.0 + 0.05 * b for b in (1, 8)}
    for b, ms in rows[Phase.PREFILL]:
        assert ms == pytest.approx(truth_prefill[b], rel=0.3)
    for b, ms in rows[Phase.DECODE]:
        assert ms == pytest.approx(truth_decode[b], rel=0.3)
    prof = read_layer_profile(tmp_path / "1xL4" / "decode_bs2time.csv")
    assert list(prof.tokens) == [1.0, 8.0]
