"""Measure per-layer profiles with vLLM on real GPUs, written in the Helix layout that MeasuredModel reads.

For each of two layer counts j1 < j2 the profiler starts ``vllm serve`` with the model truncated to j layers
(``--hf-overrides {"num_hidden_layers": j}``, dummy weights, so no download of real weights is needed beyond the
config), then measures
- prefill: wall time of a burst of concurrent prompts totalling B tokens, each with ``max_tokens=1``;
- decode: mean inter-token time of B concurrent streams with ``ignore_eos``.
The per-layer time is the slope (t(j2) - t(j1)) / (j2 - j1), which cancels the fixed per-step overhead.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import shlex
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from coral.catalog.loader import CoralInputError
from coral.perf.measured import PROFILE_FILES
from coral.perf.model import Phase

Launcher = Callable[[int], contextlib.AbstractContextManager[str]]


@dataclass(frozen=True)
class ProfileSpec:
    model_id: str
    config: str
    tensor_parallel: int
    layer_counts: tuple[int, int] = (2, 4)
    prefill_tokens: Sequence[int] = (512, 1024, 2048, 4096, 8192)
    decode_batches: Sequence[int] = (1, 4, 16, 64, 128)
    prompt_tokens: int = 512
    decode_steps: int = 32
    extra_args: Sequence[str] = field(default_factory=tuple)


def vllm_command(spec: ProfileSpec, layers: int, port: int) -> list[str]:
    """The `vllm serve` command for one truncated-model run."""
    return [
        "vllm", "serve", spec.model_id,
        "--port", str(port),
        "--tensor-parallel-size", str(spec.tensor_parallel),
        "--hf-overrides", json.dumps({"num_hidden_layers": layers}),
        "--load-format", "dummy",
        "--max-num-seqs", str(max(spec.decode_batches)),
        "--max-num-batched-tokens", str(max(spec.prefill_tokens)),
        "--max-model-len", str(spec.prompt_tokens + spec.decode_steps + 16),
        *spec.extra_args,
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def subprocess_launcher(
    spec: ProfileSpec, command_template: str | None = None, ready_timeout: float = 900.0
) -> Launcher:
    """Start one engine per layer count: `vllm serve` or a template with {layers} and {port} placeholders."""

    @contextlib.contextmanager
    def launch(layers: int) -> Iterator[str]:
        port = free_port()
        if command_template:
            cmd = shlex.split(command_template.format(layers=layers, port=port, model=spec.model_id))
        else:
            cmd = vllm_command(spec, layers, port)
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except FileNotFoundError as exc:
            raise CoralInputError(f"cannot start {cmd[0]!r}: is vLLM installed on this GPU machine?") from exc
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(url, proc, ready_timeout)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()

    return launch


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CoralInputError(f"engine exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise CoralInputError(f"engine at {url} not ready after {timeout:.0f} s")


async def measure_prefill(client: httpx.AsyncClient, url: str, model: str, tokens: int, prompt: int) -> float:
    """Seconds to prefill a burst of concurrent prompts totalling `tokens` tokens."""
    n = max(1, tokens // prompt)
    body = {"model": model, "prompt": [1] * prompt, "max_tokens": 1}
    t0 = time.perf_counter()
    rs = await asyncio.gather(*(client.post(f"{url}/v1/completions", json=body) for _ in range(n)))
    for r in rs:
        r.raise_for_status()
    return time.perf_counter() - t0


async def measure_decode(client: httpx.AsyncClient, url: str, model: str, batch: int, steps: int) -> float:
    """Mean seconds per decode step with `batch` concurrent streams."""
    body = {"model": model, "prompt": [1] * 8, "max_tokens": steps, "min_tokens": steps, "ignore_eos": True,
            "stream": True}

    async def one() -> tuple[float, float, int]:
        first = last = 0.0
        count = 0
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data:") and line.strip() != "data: [DONE]":
                    last = time.perf_counter()
                    first = first or last
                    count += 1
        return first, last, count

    spans = await asyncio.gather(*(one() for _ in range(batch)))
    per_step = [(b - a) / (c - 1) for a, b, c in spans if c > 1]
    if not per_step:
        raise CoralInputError("decode measurement got fewer than two tokens per stream")
    return sum(per_step) / len(per_step)


async def _measure_all(url: str, spec: ProfileSpec) -> dict[Phase, list[float]]:
    async with httpx.AsyncClient(timeout=600.0) as client:
        await measure_prefill(client, url, spec.model_id, spec.prompt_tokens, spec.prompt_tokens)  # warm-up
        prefill = [await measure_prefill(client, url, spec.model_id, b, spec.prompt_tokens)
                   for b in spec.prefill_tokens]
        decode = [await measure_decode(client, url, spec.model_id, b, spec.decode_steps) for b in spec.decode_batches]
    return {Phase.PREFILL: prefill, Phase.DECODE: decode}


def profile(spec: ProfileSpec, launcher: Launcher, out: Path) -> dict[Phase, list[tuple[int, float]]]:
    """Measure both layer counts and write `<out>/<config>/{prompt,decode}_bs2time.csv` (per-layer ms)."""
    j1, j2 = spec.layer_counts
    if not 0 < j1 < j2:
        raise CoralInputError("layer_counts must be two increasing positive layer counts")
    runs = {}
    for j in (j1, j2):
        with launcher(j) as url:
            runs[j] = asyncio.run(_measure_all(url, spec))
    folder = out / spec.config
    folder.mkdir(parents=True, exist_ok=True)
    written: dict[Phase, list[tuple[int, float]]] = {}
    for phase, batches in ((Phase.PREFILL, spec.prefill_tokens), (Phase.DECODE, spec.decode_batches)):
        rows = []
        for i, b in enumerate(batches):
            slope = (runs[j2][phase][i] - runs[j1][phase][i]) / (j2 - j1)
            rows.append((int(b), max(slope, 1e-6) * 1e3))
        with (folder / PROFILE_FILES[phase]).open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["tokens", "ms"])
            w.writerows((b, f"{ms:.4f}") for b, ms in rows)
        written[phase] = rows
    return written
