"""Measure per-layer profiles with vLLM on real GPUs, written in the Helix layout that MeasuredModel reads.

For each of two layer counts j1 < j2 the profiler starts ``vllm serve`` with the model truncated to j layers
(``--hf-overrides {"num_hidden_layers": j}``, dummy weights, so no download of real weights is needed beyond the
config), then measures
- prefill: wall time of a burst of concurrent prompts totalling B tokens, each with ``max_tokens=1``;
- decode: mean inter-token time of B concurrent streams with ``ignore_eos``.
The per-layer time is the slope (t(j2) - t(j1)) / (j2 - j1), which cancels the fixed per-step overhead.

On a CPU node config (`1xCPU`) the engine is vLLM's CPU build (`coral.vllm_cpu`: its own venv's Python,
`--enforce-eager`, `CPU_DTYPE`). The files are written in Helix's layout (headerless `batch,ms` rows starting with
`0,0`) next to a `profile.yaml` naming the model, the workload, the date and the command.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import datetime
import json
import os
import shlex
import socket
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO

import httpx
import yaml

from coral import vllm_cpu
from coral.catalog.loader import CoralInputError, load_file
from coral.perf.measured import MANIFEST, PROFILE_FILES, ProfileManifest
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
    repeats: int = 3
    extra_args: Sequence[str] = field(default_factory=tuple)


def vllm_command(
    spec: ProfileSpec, layers: int, port: int, python: str | None = None
) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) of one truncated-model run: `vllm serve` on GPUs; on a CPU config the CPU
    build's API server run by `python` (default `coral.vllm_cpu.vllm_python()`)."""
    argv = [
        "vllm", "serve", spec.model_id,
        "--port", str(port),
        "--tensor-parallel-size", str(spec.tensor_parallel),
        "--hf-overrides", json.dumps({"num_hidden_layers": layers}),
        "--max-num-seqs", str(max(spec.decode_batches)),
        "--max-num-batched-tokens", str(max(spec.prefill_tokens)),
    ]
    max_len = spec.prompt_tokens + spec.decode_steps + 16
    if not vllm_cpu.is_cpu_config(spec.config):
        return [*argv, "--load-format", "dummy", "--max-model-len", str(max_len), *spec.extra_args], {}
    if spec.tensor_parallel != 1:
        raise CoralInputError(f"config {spec.config}: vLLM on CPU profiles one process (1x{vllm_cpu.CPU_DEVICE})")
    argv = vllm_cpu.api_server_argv(vllm_cpu.vllm_python(python), argv)
    return [*argv, *vllm_cpu.cpu_server_args(max_len), *spec.extra_args], vllm_cpu.cpu_env()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def subprocess_launcher(
    spec: ProfileSpec, command_template: str | None = None, ready_timeout: float = 900.0, python: str | None = None
) -> Launcher:
    """Start one engine per layer count: `vllm_command` (`python` runs vLLM on CPU) or a template with {layers},
    {port} and {model} placeholders. The engine's output goes to a temporary file, quoted when it fails."""

    @contextlib.contextmanager
    def launch(layers: int) -> Iterator[str]:
        port = free_port()
        if command_template:
            cmd = shlex.split(command_template.format(layers=layers, port=port, model=spec.model_id))
            env: dict[str, str] = {}
        else:
            cmd, env = vllm_command(spec, layers, port, python)
        with tempfile.TemporaryFile() as log:
            try:
                proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
            except FileNotFoundError as exc:
                raise CoralInputError(f"cannot start {cmd[0]!r}: is vLLM installed on this machine?") from exc
            url = f"http://127.0.0.1:{port}"
            try:
                _wait_ready(url, proc, ready_timeout, log)
                yield url
            finally:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    return launch


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float, log: IO[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace").splitlines()[-15:]
            raise CoralInputError(
                f"engine exited with code {proc.returncode} before it was ready; its last lines:\n" + "\n".join(tail)
            )
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


async def _fastest(repeats: int, measure: Callable[[], Awaitable[float]]) -> float:
    """The fastest of `repeats` runs: interference from other work on the machine only ever adds time."""
    return min([await measure() for _ in range(repeats)])


async def _measure_all(url: str, spec: ProfileSpec) -> dict[Phase, list[float]]:
    async with httpx.AsyncClient(timeout=600.0) as client:
        await measure_prefill(client, url, spec.model_id, spec.prompt_tokens, spec.prompt_tokens)  # warm-up
        m, n = spec.model_id, spec.repeats
        prefill = [await _fastest(n, partial(measure_prefill, client, url, m, b, spec.prompt_tokens))
                   for b in spec.prefill_tokens]
        decode = [await _fastest(n, partial(measure_decode, client, url, m, b, spec.decode_steps))
                  for b in spec.decode_batches]
    return {Phase.PREFILL: prefill, Phase.DECODE: decode}


def profile(
    spec: ProfileSpec, launcher: Launcher, out: Path, model: str | None = None, command: str | None = None
) -> dict[Phase, list[tuple[int, float]]]:
    """Measure both layer counts and write `<out>/<config>/{prompt,decode}_bs2time.csv` (per-layer ms, Helix
    layout) and `<out>/profile.yaml` (catalog `model`, workload, date and the `command` that ran this)."""
    j1, j2 = spec.layer_counts
    if not 0 < j1 < j2:
        raise CoralInputError("layer_counts must be two increasing positive layer counts")
    manifest = _manifest(spec, out, model, command)
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
            w.writerow([0, 0])
            w.writerows((b, f"{ms:.4f}") for b, ms in rows)
        written[phase] = rows
    (out / MANIFEST).write_text(yaml.safe_dump(manifest.model_dump(exclude_none=True), sort_keys=False))
    return written


def _manifest(spec: ProfileSpec, out: Path, model: str | None, command: str | None) -> ProfileManifest:
    """`out`'s manifest with this run's model, workload and source (a folder holds one model's profiles)."""
    old = load_file(ProfileManifest, out / MANIFEST) if (out / MANIFEST).exists() else ProfileManifest()
    if model and old.model and old.model != model:
        raise CoralInputError(f"{out / MANIFEST}: the folder holds profiles of {old.model}, not {model}")
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    source = (f"{spec.config}: measured {date} by `{command or 'coral.perf.profiler.profile'}` "
              f"(layer counts {spec.layer_counts[0]} and {spec.layer_counts[1]}, dummy weights, fastest of "
              f"{spec.repeats} runs; prefill bursts of {spec.prompt_tokens}-token prompts, decode "
              f"{spec.decode_steps} steps of 8-token prompts)")
    others = [line for line in (old.source or "").splitlines() if not line.startswith(f"{spec.config}:")]
    return old.model_copy(update={
        "model": model or old.model,
        "input_tokens": float(spec.prompt_tokens),
        "output_tokens": float(spec.decode_steps),
        "source": "\n".join([*others, source]),
    })
