"""Measure per-layer profiles with vLLM on real GPUs, written in the Helix layout that MeasuredModel reads.

For each of two layer counts j1 < j2 the profiler starts ``vllm serve`` with the model truncated to j layers
(``--hf-overrides {"num_hidden_layers": j}``, dummy weights, so no download of real weights is needed beyond the
config), then measures
- prefill: wall time of a burst of concurrent prompts totalling B tokens, each with ``max_tokens=1``;
- decode: the time per step of B concurrent requests with ``ignore_eos``, from two lengths (see `measure_decode`).
The per-layer time is the slope (t(j2) - t(j1)) / (j2 - j1), which cancels the fixed per-step overhead. Every
time is a whole burst's wall time as the client sees it, so other work on the machine only ever adds to it, and the
fastest of a few runs is the estimate.

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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
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
    max_len = max(spec.prompt_tokens, DECODE_PROMPT_TOKENS + 2 * spec.decode_steps) + 16
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


Burster = Callable[[dict[str, object], int], Awaitable[float]]
"""Seconds from sending n concurrent completions of a body to the engine to its last answer."""
Connect = Callable[[str], contextlib.AbstractAsyncContextManager[Burster]]
"""Opens a `Burster` on the engine at a URL."""


@contextlib.asynccontextmanager
async def http_burster(url: str, transport: httpx.AsyncBaseTransport | None = None) -> AsyncIterator[Burster]:
    """Bursts of `/v1/completions` posts to the engine at `url`, timed by this process's wall clock."""
    async with httpx.AsyncClient(timeout=600.0, transport=transport) as client:
        async def burst(body: dict[str, object], n: int) -> float:
            t0 = time.perf_counter()
            rs = await asyncio.gather(*(client.post(f"{url}/v1/completions", json=body) for _ in range(n)))
            for r in rs:
                r.raise_for_status()
            return time.perf_counter() - t0

        yield burst


async def measure_prefill(burst: Burster, model: str, tokens: int, prompt: int) -> float:
    """Seconds to prefill a burst of concurrent prompts totalling `tokens` tokens."""
    return await burst({"model": model, "prompt": [1] * prompt, "max_tokens": 1}, max(1, tokens // prompt))


async def measure_decode(burst: Burster, model: str, batch: int, steps: int, repeats: int) -> float:
    """Seconds per decode step of `batch` concurrent requests: (T(2 `steps`) - T(`steps`)) / `steps`, where T(n)
    is the fastest of `repeats` bursts of `batch` requests of exactly n tokens (the two lengths alternate, so that
    load that comes and goes weighs on both). The difference cancels the prompts' prefill and the requests' fixed
    costs. No stream is timed chunk by chunk: a client that reads late sees chunks bunched together, which would
    shorten a step, while a late client only ever lengthens a whole burst."""
    def body(tokens: int) -> dict[str, object]:
        return {"model": model, "prompt": [1] * DECODE_PROMPT_TOKENS, "max_tokens": tokens, "min_tokens": tokens,
                "ignore_eos": True}

    short, long = float("inf"), float("inf")
    for _ in range(repeats):
        short = min(short, await burst(body(steps), batch))
        long = min(long, await burst(body(2 * steps), batch))
    if long <= short:
        raise CoralInputError(
            f"decode measurement at batch {batch}: {2 * steps} tokens took no longer than {steps} "
            f"({long * 1e3:.1f} ms against {short * 1e3:.1f} ms): the machine is too busy to time; profile on a "
            "quieter machine, with more repeats or with more decode steps")
    return (long - short) / steps


async def _fastest(repeats: int, measure: Callable[[], Awaitable[float]]) -> float:
    """The fastest of `repeats` runs: interference from other work on the machine only ever adds time."""
    return min([await measure() for _ in range(repeats)])


async def _measure_all(url: str, spec: ProfileSpec, connect: Connect) -> dict[Phase, list[float]]:
    async with connect(url) as burst:
        await measure_prefill(burst, spec.model_id, spec.prompt_tokens, spec.prompt_tokens)  # warm-up
        m, n = spec.model_id, spec.repeats
        prefill = [await _fastest(n, partial(measure_prefill, burst, m, b, spec.prompt_tokens))
                   for b in spec.prefill_tokens]
        decode = [await measure_decode(burst, m, b, spec.decode_steps, n) for b in spec.decode_batches]
    return {Phase.PREFILL: prefill, Phase.DECODE: decode}


def profile(
    spec: ProfileSpec, launcher: Launcher, out: Path, model: str | None = None, command: str | None = None,
    connect: Connect = http_burster,
) -> dict[Phase, list[tuple[int, float]]]:
    """Measure both layer counts (each engine started by `launcher`, reached through `connect`) and write
    `<out>/<config>/{prompt,decode}_bs2time.csv` (per-layer ms, Helix layout) and `<out>/profile.yaml` (catalog
    `model`, workload, date and the `command` that ran this)."""
    j1, j2 = spec.layer_counts
    if not 0 < j1 < j2:
        raise CoralInputError("layer_counts must be two increasing positive layer counts")
    manifest = _manifest(spec, out, model, command)
    runs = {}
    for j in (j1, j2):
        with launcher(j) as url:
            runs[j] = asyncio.run(_measure_all(url, spec, connect))
    written: dict[Phase, list[tuple[int, float]]] = {}
    for phase, batches in ((Phase.PREFILL, spec.prefill_tokens), (Phase.DECODE, spec.decode_batches)):
        rows = []
        for i, b in enumerate(batches):
            slope = (runs[j2][phase][i] - runs[j1][phase][i]) / (j2 - j1)
            if slope <= 0:
                raise CoralInputError(
                    f"{spec.config} {phase.value} at {b}: {j2} layers measured no slower than {j1} "
                    f"({runs[j2][phase][i] * 1e3:.2f} ms against {runs[j1][phase][i] * 1e3:.2f} ms), so the "
                    "per-layer time is noise; profile on a quieter machine, with more repeats or layers apart")
            rows.append((int(b), slope * 1e3))
        written[phase] = rows
    folder = out / spec.config
    folder.mkdir(parents=True, exist_ok=True)
    for phase, rows in written.items():
        with (folder / PROFILE_FILES[phase]).open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow([0, 0])
            w.writerows((b, f"{ms:.4f}") for b, ms in rows)
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
              f"bursts of {spec.decode_steps} and {2 * spec.decode_steps} tokens after 8-token prompts)")
    others = [line for line in (old.source or "").splitlines() if not line.startswith(f"{spec.config}:")]
    return old.model_copy(update={
        "model": model or old.model,
        "input_tokens": float(spec.prompt_tokens),
        "output_tokens": float(spec.decode_steps),
        "source": "\n".join([*others, source]),
    })
