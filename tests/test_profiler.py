"""The vLLM profiler: its arithmetic end to end on batching engines with a fake clock (seeded, so no test here
depends on this machine's load), its HTTP bursts and engine processes on loopback, the CPU command, the shipped
CPU profile, and (marked `vllm`) a real run against vLLM's CPU build."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from coral import vllm_cpu
from coral.catalog.loader import CoralInputError, builtin_catalog, data_path
from coral.perf import Phase, Workload
from coral.perf.measured import MeasuredModel, ProfileSet, read_layer_profile
from coral.perf.profiler import (
    Burster,
    Connect,
    ProfileSpec,
    http_burster,
    measure_decode,
    profile,
    subprocess_launcher,
    vllm_command,
)

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


PREFILL_MS = (2.0, 1.0, 0.004)  # per batch, per layer, per layer and token
DECODE_MS = (2.0, 2.0, 0.05)  # per step, per layer, per layer and sequence


def fake_engines(lateness_ms: float, seed: int = 0) -> Connect:
    """Batching engines on a fake clock, one per URL `fake://<layers>`: a burst of n requests is one prefill of all
    their prompt tokens, then `max_tokens` - 1 decode steps of n sequences (costs above), plus a reader late by a
    seeded exponential number of ms of mean `lateness_ms` (a busy machine only ever adds time)."""
    rng = np.random.default_rng(seed)

    @contextlib.asynccontextmanager
    async def connect(url: str) -> AsyncIterator[Burster]:
        layers = int(url.removeprefix("fake://"))

        async def burst(body: dict[str, object], n: int) -> float:
            prompt, steps = len(body["prompt"]), int(body["max_tokens"]) - 1  # type: ignore[arg-type]
            ms = PREFILL_MS[0] + layers * (PREFILL_MS[1] + PREFILL_MS[2] * n * prompt)
            ms += steps * (DECODE_MS[0] + layers * (DECODE_MS[1] + DECODE_MS[2] * n))
            return (ms + rng.exponential(lateness_ms)) / 1e3 if lateness_ms else ms / 1e3

        yield burst

    return connect


@contextlib.contextmanager
def _fake_url(layers: int) -> Iterator[str]:
    yield f"fake://{layers}"


@pytest.mark.parametrize(("lateness_ms", "rel"), [(0.0, 1e-9), (2.0, 0.05)])
def test_profile_recovers_per_layer_costs(tmp_path: Path, lateness_ms: float, rel: float) -> None:
    """Exactly on a quiet fake clock; within 5 % when a seeded late reader adds up to several ms to each burst."""
    spec = ProfileSpec("fake", "1xL4", 1, layer_counts=(4, 16), prefill_tokens=(512, 4096),
                       decode_batches=(1, 8), prompt_tokens=512, decode_steps=10)
    rows = profile(spec, _fake_url, tmp_path, connect=fake_engines(lateness_ms))
    assert [b for b, _ in rows[Phase.PREFILL]] == [512, 4096] and [b for b, _ in rows[Phase.DECODE]] == [1, 8]
    for b, ms in rows[Phase.PREFILL]:
        assert ms == pytest.approx(PREFILL_MS[1] + PREFILL_MS[2] * b, rel=rel)
    for b, ms in rows[Phase.DECODE]:
        assert ms == pytest.approx(DECODE_MS[1] + DECODE_MS[2] * b, rel=rel)
    prof = read_layer_profile(tmp_path / "1xL4" / "decode_bs2time.csv")
    assert list(prof.tokens) == [1.0, 8.0]
    assert (tmp_path / "1xL4" / "prompt_bs2time.csv").read_text().startswith("0,0\n")


def test_more_layers_measured_no_slower_is_an_error_and_writes_nothing(tmp_path: Path) -> None:
    @contextlib.asynccontextmanager
    async def flat(url: str) -> AsyncIterator[Burster]:
        async def burst(body: dict[str, object], n: int) -> float:
            return 0.001 * int(body["max_tokens"])  # type: ignore[call-overload]

        yield burst

    spec = ProfileSpec("fake", "1xL4", 1, layer_counts=(4, 16), prefill_tokens=(512,), decode_batches=(1,))
    with pytest.raises(CoralInputError, match="16 layers measured no slower than 4"):
        profile(spec, _fake_url, tmp_path, connect=flat)
    assert list(tmp_path.iterdir()) == []


def test_subprocess_launcher_serves_until_the_block_ends_and_quotes_an_engine_that_dies(tmp_path: Path) -> None:
    spec = ProfileSpec("fake", "1xL4", 1)
    launcher = subprocess_launcher(spec, f"{sys.executable} {FAKE} --layers {{layers}} --port {{port}}", 60)
    with launcher(2) as url:
        r = httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": [1, 2], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "tok tok tok"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")
    dying = subprocess_launcher(spec, f"{sys.executable} -c \"print('no GPU here'); raise SystemExit(3)\"", 60)
    with pytest.raises(CoralInputError, match=r"(?s)exited with code 3.*no GPU here"), dying(2):
        pass


@pytest.mark.vllm
def test_profile_runs_for_real_on_vllm_cpu(tmp_path: Path) -> None:
    """Two real vLLM CPU servers (1 and 8 layers of the tiny model: far enough apart to time on a busy machine), a
    couple of batch sizes per phase."""
    from coral.tiny_model import make_tiny_llama

    python = vllm_cpu.vllm_python()
    if vllm_cpu.installed_version(python) is None:
        pytest.skip(f"vLLM is not importable by {python}: `python -m coral.vllm_cpu` installs it")
    tiny = make_tiny_llama(tmp_path / "tiny", weights=False)
    spec = ProfileSpec(str(tiny), "1xCPU", 1, layer_counts=(1, 8), prefill_tokens=(256, 512),
                       decode_batches=(1, 2), prompt_tokens=256, decode_steps=8)
    rows = profile(spec, subprocess_launcher(spec, ready_timeout=600), tmp_path / "out", vllm_cpu.TINY_MODEL,
                   "test")
    pset = ProfileSet.read(tmp_path / "out")
    assert pset.manifest.model == vllm_cpu.TINY_MODEL and pset.manifest.workload == Workload(256, 8)
    for phase, batches in ((Phase.PREFILL, spec.prefill_tokens), (Phase.DECODE, spec.decode_batches)):
        assert [b for b, _ in rows[phase]] == list(batches)
        assert list(pset.profiles[("1xCPU", phase)].tokens) == list(batches)
        assert all(ms > 0 for _, ms in rows[phase])


def test_http_bursts_post_concurrent_completions_and_fail_on_an_error_answer() -> None:
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        assert request.url.path == "/v1/completions"
        return httpx.Response(500 if seen[-1]["max_tokens"] == 9 else 200, json={"choices": [{"text": "x"}]})

    async def go() -> float:
        async with http_burster("http://x", httpx.MockTransport(handler)) as burst:
            took = await burst({"max_tokens": 1}, 3)
            with pytest.raises(httpx.HTTPStatusError):
                await burst({"max_tokens": 9}, 1)
            return took

    assert asyncio.run(go()) >= 0 and [b["max_tokens"] for b in seen] == [1, 1, 1, 9]


def _clocked(step: float, lateness: list[float]) -> tuple[Burster, list[dict]]:
    """A burster whose bursts take 5 ms plus `step` s a token, and whose reader is late by the next entry of
    `lateness` (then 0). Returns it and the bodies asked for."""
    asked: list[dict] = []

    async def burst(body: dict[str, object], n: int) -> float:
        asked.append(body)
        return 0.005 + step * int(body["max_tokens"]) + (lateness.pop(0) if lateness else 0.0)  # type: ignore[call-overload]

    return burst, asked


def test_decode_step_is_the_difference_of_two_lengths_over_the_fastest_bursts() -> None:
    """Bursts of 4 and 8 tokens at 10 ms a token are 40 ms apart, 10 ms a step; a reader late on some bursts only
    lengthens them, and the fastest of the repeats is kept."""
    burst, asked = _clocked(0.010, [0.5, 0.0, 0.0, 0.3])
    assert asyncio.run(measure_decode(burst, "m", 1, 4, 3)) == pytest.approx(0.010)
    assert [b["max_tokens"] for b in asked] == [4, 8] * 3
    assert all(b["min_tokens"] == b["max_tokens"] and b["ignore_eos"] and not b.get("stream") for b in asked)


def test_decode_that_a_busy_machine_makes_no_longer_for_twice_the_tokens_is_an_error() -> None:
    burst, _ = _clocked(0.0, [])
    with pytest.raises(CoralInputError, match="too busy to time"):
        asyncio.run(measure_decode(burst, "m", 2, 4, 2))
