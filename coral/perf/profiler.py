"""Measure per-layer profiles with vLLM on real GPUs, written in the Helix layout that MeasuredModel reads.

For each of two layer counts j1 < j2 the profiler starts ``vllm serve`` with the model truncated to j layers
(``--hf-overrides {"num_hidden_layers": j}``, dummy weights, so no download of real weights is needed beyond the
config), then measures
- prefill: wall time of a burst of concurrent prompts totalling B tokens, each with ``max_tokens=1``;
- decode: mean time per generated token of B concurrent streams with ``ignore_eos`` (tokens counted from the
  server's running usage, since a loaded server merges tokens into fewer chunks; see `measure_decode`).
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
DECODE_PROMPT_TOKENS = 8
DECODE_RETRY_FACTOR = 8
"""A decode burst whose every stream came in one chunk is run again with this many times the tokens."""


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
    max_len = max(spec.prompt_tokens, DECODE_PROMPT_TOKENS + spec.decode_steps * DECODE_RETRY_FACTOR) + 16
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
                wait_ready(url, proc, ready_timeout, log)
                yield url
            finally:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    return launch


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float, log: IO[bytes]) -> None:
    """Until the server at `url` answers /health; CoralInputError with the tail of its `log` (opened for
    reading and writing) when its process exits first, or after `timeout` s."""
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


async def measure_decode(
    client: httpx.AsyncClient, url: str, model: str, batch: int, steps: int,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Mean seconds per decode step with `batch` concurrent streams of `steps` tokens.

    Steps are counted in tokens, not in chunks: when the API server falls behind the engine (a loaded machine),
    vLLM merges a stream's unsent tokens into one chunk, so a stream of 4 tokens can arrive as 1 or 2 chunks.
    Each chunk carries the stream's running token count (`continuous_usage_stats`; a server that sends no usage
    counts one token a chunk), and a stream's step time is the time between its first and its last chunk over
    the tokens generated between them. A stream whose tokens all came in one chunk spans no step; if every
    stream did, the burst runs once more with `DECODE_RETRY_FACTOR` times the tokens (more steps for the
    server to fall behind over) before the measurement fails."""
    for budget in (steps, steps * DECODE_RETRY_FACTOR):
        spans = await asyncio.gather(*(_decode_stream(client, url, model, budget, clock) for _ in range(batch)))
        per_step = [(t1 - t0) / (n1 - n0) for (t0, n0), (t1, n1) in spans if n1 > n0]
        if per_step:
            return sum(per_step) / len(per_step)
    raise CoralInputError(
        f"decode measurement: each of {batch} streams delivered all its tokens in one chunk, twice (the second "
        f"time {steps * DECODE_RETRY_FACTOR} tokens): the server's API process is starved; profile on a quieter "
        "machine or with more decode steps")


async def _decode_stream(
    client: httpx.AsyncClient, url: str, model: str, steps: int, clock: Callable[[], float]
) -> tuple[tuple[float, int], tuple[float, int]]:
    """(time, tokens so far) at the first and at the last chunk of one stream of exactly `steps` tokens."""
    body = {"model": model, "prompt": [1] * DECODE_PROMPT_TOKENS, "max_tokens": steps, "min_tokens": steps,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    marks: list[tuple[float, int]] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            now, chunk = clock(), json.loads(line[len("data:"):])
            if not chunk.get("choices"):  # the closing usage chunk carries no token
                continue
            counted = (chunk.get("usage") or {}).get("completion_tokens")
            marks.append((now, int(counted) if counted else (marks[-1][1] if marks else 0) + 1))
    if not marks:
        raise CoralInputError(f"decode measurement: a stream from {url} sent no token")
    return marks[0], marks[-1]


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
