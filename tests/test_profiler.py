"""The vLLM profiler end to end against a batching stand-in engine on loopback (real HTTP, real processes), the
CPU command, the shipped CPU profile, and (marked `vllm`) a real run against vLLM's CPU build."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from coral import vllm_cpu
from coral.catalog.loader import CoralInputError, builtin_catalog, data_path
from coral.perf import Phase, Workload
from coral.perf.measured import MeasuredModel, ProfileSet, read_layer_profile
from coral.perf.profiler import ProfileSpec, measure_decode, profile, subprocess_launcher, vllm_command

FAKE = Path(__file__).with_name("fake_vllm.py")


def test_vllm_command_truncates_layers_and_uses_dummy_weights() -> None:
    spec = ProfileSpec("Qwen/Qwen3-32B", "2xL40S", tensor_parallel=2)
    cmd, env = vllm_command(spec, 4, 8123)
    assert cmd[:3] == ["vllm", "serve", "Qwen/Qwen3-32B"] and env == {}
    assert cmd[cmd.index("--hf-overrides") + 1] == '{"num_hidden_layers": 4}'
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--load-format") + 1] == "dummy"


def test_cpu_command_runs_the_api_server_with_the_vllm_python() -> None:
    spec = ProfileSpec("/models/tiny", "1xCPU", tensor_parallel=1)
    cmd, env = vllm_command(spec, 2, 8123, python="/venv/bin/python")
    assert cmd[:5] == ["/venv/bin/python", "-m", vllm_cpu.API_SERVER_MODULE, "--model", "/models/tiny"]
    assert cmd[cmd.index("--hf-overrides") + 1] == '{"num_hidden_layers": 2}'
    assert "--enforce-eager" in cmd and cmd.count("--max-model-len") == 1
    assert env == vllm_cpu.cpu_env()
    with pytest.raises(CoralInputError, match="one process"):
        vllm_command(ProfileSpec("/models/tiny", "2xCPU", tensor_parallel=2), 2, 8123, python="python")


def test_shipped_cpu_profile_loads_in_the_measured_model() -> None:
    folder = data_path("profiles", "tiny-llama-cpu")
    pset = ProfileSet.read(folder)
    assert set(pset.profiles) == {("1xCPU", Phase.PREFILL), ("1xCPU", Phase.DECODE)}
    assert pset.manifest.model == vllm_cpu.TINY_MODEL and "coral perf profile" in (pset.manifest.source or "")
    first = (folder / "1xCPU" / "decode_bs2time.csv").read_text().splitlines()[0]
    assert first == "0,0"  # Helix layout: headerless, starting at batch 0
    cat = builtin_catalog()
    model, node = MeasuredModel.from_folder(folder), cat.node_config("1xCPU")
    arch = cat.model(vllm_cpu.TINY_MODEL)
    for phase in Phase:
        prof = pset.profiles[("1xCPU", phase)]
        t = model.step_time(arch, phase, node, 3, prof.tokens, Workload(512, 32))
        assert np.allclose(t, 3 * prof.seconds)


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
    assert (tmp_path / "1xL4" / "prompt_bs2time.csv").read_text().startswith("0,0\n")


@pytest.mark.vllm
def test_profile_runs_for_real_on_vllm_cpu(tmp_path: Path) -> None:
    """Two real vLLM CPU servers (1 and 2 layers of the tiny model), a couple of batch sizes per phase."""
    from coral.tiny_model import make_tiny_llama

    python = vllm_cpu.vllm_python()
    if vllm_cpu.installed_version(python) is None:
        pytest.skip(f"vLLM is not importable by {python}: `python -m coral.vllm_cpu` installs it")
    tiny = make_tiny_llama(tmp_path / "tiny", weights=False)
    spec = ProfileSpec(str(tiny), "1xCPU", 1, layer_counts=(1, 2), prefill_tokens=(64, 128),
                       decode_batches=(1, 2), prompt_tokens=64, decode_steps=4)
    rows = profile(spec, subprocess_launcher(spec, ready_timeout=600), tmp_path / "out", vllm_cpu.TINY_MODEL,
                   "test")
    pset = ProfileSet.read(tmp_path / "out")
    assert pset.manifest.model == vllm_cpu.TINY_MODEL and pset.manifest.workload == Workload(64, 4)
    for phase, batches in ((Phase.PREFILL, spec.prefill_tokens), (Phase.DECODE, spec.decode_batches)):
        assert [b for b, _ in rows[phase]] == list(batches)
        assert list(pset.profiles[("1xCPU", phase)].tokens) == list(batches)
        assert all(ms > 0 for _, ms in rows[phase])


def _stream_server(chunkings: list[list[int]], clock: list[float]) -> tuple[httpx.AsyncClient, list[int]]:
    """A client whose server streams each request's tokens in the chunk sizes of the next entry of `chunkings`,
    as a server that falls behind merges tokens, with vLLM's running usage on every chunk and its closing usage
    chunk; the fake `clock` moves 10 ms a token after the first chunk (so that only streams of several chunks
    move it, whatever the interleaving). Returns the client and the `max_tokens` asked for."""
    asked: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        asked.append(body["max_tokens"])
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        sizes = chunkings[len(asked) - 1]
        assert sum(sizes) == body["max_tokens"]

        async def chunks() -> AsyncIterator[bytes]:
            done = 0
            for n in sizes:
                clock[0] += 0.010 * n if done else 0.0
                done += n
                yield f'data: {json.dumps({"choices": [{"text": "x"}], "usage": {"completion_tokens": done}})}\n\n'.encode()
            yield f'data: {json.dumps({"choices": [], "usage": {"completion_tokens": done}})}\n\ndata: [DONE]\n\n'.encode()

        return httpx.Response(200, content=chunks())

    return httpx.AsyncClient(transport=httpx.MockTransport(handler)), asked


def test_decode_counts_tokens_not_chunks() -> None:
    """Four tokens merged into chunks of 1 and 3 are three steps after the first chunk, not one."""
    clock = [0.0]
    client, asked = _stream_server([[1, 3]], clock)
    per_step = asyncio.run(measure_decode(client, "http://x", "m", 1, 4, clock=lambda: clock[0]))
    assert per_step == pytest.approx(0.010) and asked == [4]


def test_decode_all_in_one_chunk_retries_with_more_tokens_then_fails() -> None:
    clock = [0.0]
    client, asked = _stream_server([[4], [4], [2, 30], [32]], clock)
    per_step = asyncio.run(measure_decode(client, "http://x", "m", 2, 4, clock=lambda: clock[0]))
    assert asked == [4, 4, 32, 32] and per_step == pytest.approx(0.300 / 30)
    client, asked = _stream_server([[4], [32]], clock)
    with pytest.raises(CoralInputError, match="one chunk, twice"):
        asyncio.run(measure_decode(client, "http://x", "m", 1, 4, clock=lambda: clock[0]))
