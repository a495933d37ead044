"""The Coral engine on one CUDA GPU, offline: a Llama-3-8B-architecture model made locally, whole vs 2 stages.

    python benchmarks/gpu_engine.py [--device cuda] [--layers 32] [--out out/benchmarks/gpu_engine]
    python benchmarks/gpu_engine.py --device cpu        # the same steps at a tiny size (a test runs this)

Nothing is downloaded: the script writes the config (Llama-3-8B's shapes: 32 layers, hidden 4096, MLP 14336,
32 query / 8 KV heads, vocab 128256, rope theta 5e5), a byte-level BPE tokenizer trained locally, and seeded
random bf16 weights (one safetensors file per layer, ~16 GB at full size) under `--workdir`. Then:

1. Exactness: the same prompts, greedy, on the whole model as one Coral node and as a 2-stage pipeline (two nodes
   on the same device, as threads of this process: NCCL does not pair two processes on one GPU). Requests sent
   one at a time must give identical tokens and logits (same micro-batches, same kernels); requests sent
   together are reported (bf16 micro-batches of different shapes round differently). Also compared with
   `transformers` running the model whole (reported: bf16 ties can flip a greedy token).
2. Throughput: output tokens/s of `--requests` concurrent requests, whole vs pipeline.
3. A measured per-layer profile (Helix layout, as `coral perf profile` writes, readable by `ProfileSet.read`):
   prefill and decode step times of shards of two layer counts, per-layer ms as the slope, in
   `<out>/<config>/{prompt,decode}_bs2time.csv` with `<out>/profile.yaml`. `--clock work` times each step by
   its work instead (`work_seconds`: layers x tokens), so a loaded machine (or a test) gets the same profile every
   run; that profile is the work model's, not a measurement, and its manifest says so.

Writes `<out>/gpu_engine.json` and prints a summary.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from _console import stamped_json  # benchmarks/_console.py

from coral.engine.instance import CoralInstance, EngineConfig
from coral.engine.layout import Layout
from coral.engine.reference import WholeModel
from coral.engine.scheduler import Request
from coral.engine.shard import Shard, Step
from coral.perf.measured import MANIFEST, PROFILE_FILES, ProfileManifest, ProfileSet
from coral.perf.model import Phase
from coral.tiny_model import ARCHITECTURES, TinyLlamaSpec, TinySpec, make_tiny, make_tiny_llama


@dataclass(frozen=True)
class Size:
    """Model shape and workload of a run."""

    spec: TinyLlamaSpec
    prompt: int  # tokens per prompt (exactness, throughput, decode context)
    output: int
    requests: int
    prefill_tokens: tuple[int, ...]
    decode_batches: tuple[int, ...]
    layer_counts: tuple[int, int]
    kv_gib: float
    catalog_model: str  # the catalog entry of these shapes: what the written profile names
    repeats: int  # timed runs of each profiled step (the median is kept)


LLAMA3_8B = Size(
    TinyLlamaSpec(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, initializer_range=0.02),
    prompt=512, output=32, requests=32, prefill_tokens=(512, 1024, 2048, 4096, 8192),
    decode_batches=(1, 4, 16, 64, 128), layer_counts=(2, 4), kv_gib=16.0, catalog_model="llama-3-8b",
    repeats=5,
)
TINY = Size(  # the catalog's tiny-llama shapes
    TinyLlamaSpec(num_hidden_layers=4, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1024, max_position_embeddings=8192, initializer_range=0.02),
    prompt=16, output=4, requests=4, prefill_tokens=(16, 64), decode_batches=(1, 4), layer_counts=(1, 4),
    kv_gib=0.01, catalog_model="tiny-llama", repeats=15,  # steps of milliseconds on a shared CPU: more samples
)


def make_model(out: Path, spec: TinyLlamaSpec, seed: int = 0) -> Path:
    """Config (Llama-3 rope and bf16) and tokenizer, then seeded random bf16 weights written one layer at a time
    (generated on the GPU when there is one), with a safetensors index."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    stamp = out / "coral_gpu_engine.json"
    if stamp.exists() and json.loads(stamp.read_text()) == {"spec": repr(spec), "seed": seed}:
        return out
    make_tiny_llama(out, spec, weights=False)  # tokenizer and a float32 config of these shapes
    config = LlamaConfig.from_pretrained(out)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    config.dtype = "bfloat16"
    config.save_pretrained(out)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    gen_device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(gen_device).manual_seed(seed)
    groups: dict[str, list[str]] = {}
    for name in shapes:
        part = name.split(".")
        key = f"layer{int(part[2]):03d}" if name.startswith("model.layers.") else "other"
        groups.setdefault(key, []).append(name)
    weight_map = {}
    for key, names in groups.items():
        tensors = {}
        for name in names:
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(shapes[name], dtype=torch.bfloat16)
            else:
                w = torch.randn(shapes[name], generator=gen, device=gen_device, dtype=torch.float32)
                tensors[name] = (w * spec.initializer_range).to(torch.bfloat16).cpu()
        fname = f"model-{key}.safetensors"
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, fname))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    stamp.write_text(json.dumps({"spec": repr(spec), "seed": seed}))
    return out


def generate(inst: CoralInstance, prompts: list[list[int]], output: int, together: bool, logits: bool = True
             ) -> tuple[list[list[int]], list[torch.Tensor], float]:
    """Greedy tokens and (with `logits`: every step's whole vocabulary row travels back, which costs far more
    than the step on a GPU) logits per prompt, and seconds: all submitted at once, or one after another."""
    sched = inst.scheduler
    assert sched is not None
    tokens: list[list[int]] = [[] for _ in prompts]
    rows: list[list[list[float]]] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def on_event(i: int) -> Callable[[int | None, str | None, list[float] | None], None]:
        def handle(token: int | None, finish: str | None, lg: list[float] | None) -> None:
            if token is not None:
                tokens[i].append(token)
                rows[i].append(lg or [])
            if finish is not None:
                done[i].set()

        return handle

    start = time.perf_counter()
    for i, p in enumerate(prompts):
        sched.submit(Request(rid=f"g{start}-{i}", prompt=p, max_tokens=output, on_event=on_event(i),
                             want_logits=logits))
        if not together and not done[i].wait(1800):
            raise TimeoutError("request did not finish")
    for ev in done:
        if not ev.wait(1800):
            raise TimeoutError("request did not finish")
    return tokens, [torch.tensor(lg) for lg in rows], time.perf_counter() - start


def architectures_check(device: str, workdir: Path) -> dict[str, dict[str, object]]:
    """Every catalog architecture's tiny checkpoint (float32) on `device`: greedy tokens of the whole model as one
    Coral node and as an uneven 2-stage pipeline against transformers run whole on the same device."""
    prompts = [[11, 52, 300, 7, 9, 400, 23, 81, 5, 640, 77, 12, 3], [500]]
    out: dict[str, dict[str, object]] = {}
    for arch in ARCHITECTURES:
        ckpt = make_tiny(arch, workdir / f"tiny-{arch}", TinySpec(initializer_range=0.25))
        reference = WholeModel(ckpt, device)
        want = [reference.greedy(p, 8)[0] for p in prompts]
        del reference
        row: dict[str, object] = {}
        cfg = EngineConfig(local=True, http=False, device=device, kv_cache_gib=0.01, max_batch=4)
        for name, layout in (("whole", Layout.of([4], [["whole"]])), ("pipeline 1+3", Layout.of([1, 3], [["a"], ["b"]]))):
            inst = CoralInstance(layout, ckpt, cfg).start()
            try:
                got, _, _ = generate(inst, prompts, 8, together=True, logits=False)
            finally:
                inst.stop()
            row[name] = got == want
        out[arch] = row
        print(f"{arch}: {row}", file=sys.stderr)
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Timer = Callable[[Shard, list[Step], torch.Tensor], float]
"""Runs one micro-batch on a shard and says how long it took."""

WORK_S_PER_LAYER_TOKEN = 1e-5
WORK_S_PER_STEP = 1e-4


def wall_seconds(shard: Shard, steps: list[Step], x: torch.Tensor) -> float:
    """The micro-batch's wall-clock time (the device synchronised before and after)."""
    sync(shard.device)
    t = time.perf_counter()
    shard.forward_batch(steps, x)
    sync(shard.device)
    return time.perf_counter() - t


def work_seconds(shard: Shard, steps: list[Step], x: torch.Tensor) -> float:
    """The micro-batch run, timed by its work, not the clock: `WORK_S_PER_LAYER_TOKEN` per layer and token plus
    `WORK_S_PER_STEP` (what the layer-count slope cancels), the same on any machine and load."""
    shard.forward_batch(steps, x)
    return WORK_S_PER_STEP + WORK_S_PER_LAYER_TOKEN * len(shard.layers) * sum(s.n for s in steps)


CLOCKS: dict[str, Timer] = {"wall": wall_seconds, "work": work_seconds}


def step_seconds(shard: Shard, steps: list[Step], x: torch.Tensor, repeats: int = 5,
                 timer: Timer = wall_seconds) -> float:
    """Median of `repeats` runs of one micro-batch timed by `timer`, after a warm-up run (each request's KV reset
    to its step's start before each run)."""
    times = []
    for k in range(repeats + 1):
        for s in steps:
            tokens = shard.pool.tokens.get(s.rid, 0)
            if tokens > s.start:
                shard.pool.tokens[s.rid] = s.start  # rewrite the step's slots
        took = timer(shard, steps, x)
        if k:
            times.append(took)
    return sorted(times)[len(times) // 2]


def layer_profile(ckpt: Path, size: Size, device: str,
                  timer: Timer = wall_seconds) -> dict[Phase, list[tuple[int, float]]]:
    """Per-layer ms by batch tokens: prefill (`size.prefill_tokens` as bursts of `size.prompt`-token prompts)
    and decode (a step of B requests with a `size.prompt`-token context), the slope between shards of two layer
    counts (which cancels the embedding and the per-step overhead). A point whose slope is not positive (noise
    larger than the layers' time) is left out and named on stderr, never clamped to a made-up value."""
    times: dict[int, dict[Phase, list[float]]] = {}
    vocab = size.spec.vocab_size
    for j in size.layer_counts:
        shard = Shard(ckpt, 0, j, device, kv_cache_gib=size.kv_gib)
        rows: dict[Phase, list[float]] = {Phase.PREFILL: [], Phase.DECODE: []}
        for total in size.prefill_tokens:
            steps = [Step(f"p{total}-{k}", 0, size.prompt, False) for k in range(max(total // size.prompt, 1))]
            x = torch.randint(7, vocab, (sum(s.n for s in steps),))
            rows[Phase.PREFILL].append(step_seconds(shard, steps, x, size.repeats, timer))
            for s in steps:
                shard.free(s.rid)
        for batch in size.decode_batches:
            rids = [f"d{batch}-{k}" for k in range(batch)]
            shard.forward_batch([Step(r, 0, size.prompt, False) for r in rids],
                                torch.randint(7, vocab, (batch * size.prompt,)))
            steps = [Step(r, size.prompt, 1) for r in rids]
            rows[Phase.DECODE].append(step_seconds(shard, steps, torch.randint(7, vocab, (batch,)), size.repeats,
                                                   timer))
            for r in rids:
                shard.free(r)
        times[j] = rows
        del shard
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    j1, j2 = size.layer_counts
    rows = {}
    for phase, batches in ((Phase.PREFILL, size.prefill_tokens), (Phase.DECODE, size.decode_batches)):
        rows[phase] = []
        for i, b in enumerate(batches):
            slope = (times[j2][phase][i] - times[j1][phase][i]) / (j2 - j1)
            if slope > 0:
                rows[phase].append((b, slope * 1e3))
            else:
                print(f"{phase} batch {b}: {j2} layers not slower than {j1} ({times[j2][phase][i] * 1e3:.3f} vs "
                      f"{times[j1][phase][i] * 1e3:.3f} ms): point left out", file=sys.stderr)
        if not rows[phase]:
            raise RuntimeError(f"{phase}: no point where more layers took longer: too noisy to profile")
    return rows


def write_profile(out: Path, config: str, rows: dict[Phase, list[tuple[int, float]]], size: Size,
                  clock: str = "wall") -> None:
    """Helix layout: headerless `batch,ms` rows from `0,0`, and the folder's profile.yaml (whose source says
    when the `clock` was the work model's)."""
    folder = out / config
    folder.mkdir(parents=True, exist_ok=True)
    for phase, pairs in rows.items():
        lines = ["0,0", *(f"{b},{ms:.4f}" for b, ms in pairs)]
        (folder / PROFILE_FILES[phase]).write_text("\n".join(lines) + "\n")
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    manifest = ProfileManifest(
        model=size.catalog_model, input_tokens=float(size.prompt),
        output_tokens=float(size.output), configs={config: config},
        source=f"{config}: measured {date} by `python {' '.join(sys.argv)}` with the Coral engine's shard on "
               f"{size.catalog_model}'s shapes, random weights (layer counts {size.layer_counts}, median of "
               f"{size.repeats})" + ("; timed by the work clock (layers x tokens), not measured" if clock == "work"
                                     else ""),
    )
    (out / MANIFEST).write_text(yaml.safe_dump(manifest.model_dump(exclude_none=True), sort_keys=False))


def predicted_vs_measured(out: Path, size: Size) -> list[dict[str, object]]:
    """The shipped performance model's per-layer time beside each measured point of the profile just written
    (read back as `coral perf calibrate` reads it), printed as a table."""
    from _console import table_console  # benchmarks/_console.py
    from rich.table import Table

    from coral.catalog.loader import builtin_catalog
    from coral.perf import PerfParams, RooflineModel, Workload

    cat = builtin_catalog()
    profiles = ProfileSet.read(out, None, cat)
    arch = cat.model(size.catalog_model)
    perf = RooflineModel(PerfParams.load(None))
    workload = Workload(float(size.prompt), float(size.output))
    rows: list[dict[str, object]] = []
    table = Table("config", "phase", "batch tokens", "measured ms/layer", "predicted ms/layer", "predicted / measured",
                  title=f"shipped performance model vs this run ({size.catalog_model})")
    for (config, phase), prof in profiles.profiles.items():
        pred = perf.layer_time(arch, phase, cat.node_config(config), prof.tokens, workload)
        for b, measured, p in zip(prof.tokens, prof.seconds, pred, strict=True):
            rows.append({"config": config, "phase": str(phase), "batch": float(b), "measured_ms": 1e3 * float(measured),
                         "predicted_ms": 1e3 * float(p), "ratio": float(p / measured)})
            table.add_row(config, str(phase), f"{b:.0f}", f"{1e3 * measured:.4f}", f"{1e3 * p:.4f}",
                          f"{p / measured:.2f}")
    table_console(stderr=True, pipe_width=120).print(table)
    return rows


def gpu_config(device: str) -> str:
    """A node config name for the device: '1xH200' from 'NVIDIA H200', '1xCPU' on the CPU."""
    if torch.device(device).type != "cuda":
        return "1xCPU"
    name = torch.cuda.get_device_name(torch.device(device)).replace("NVIDIA ", "").split()[0]
    return f"1x{name}"


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda | cuda:N | cpu (cpu: tiny size)")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (default: 32, or 4 on the CPU)")
    ap.add_argument("--workdir", type=Path, default=None, help="where the model is written (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=Path("out/benchmarks/gpu_engine"))
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="what times the profiled steps: wall (measured) | work (layers x tokens: the same profile "
                    "on any machine and load, for tests; not a measurement)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu for the tiny size")
    size = TINY if device.type == "cpu" else LLAMA3_8B
    if args.layers:
        size = Size(**{**size.__dict__, "spec": TinyLlamaSpec(**{**size.spec.__dict__,
                                                                   "num_hidden_layers": args.layers})})
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda:0")
    tmp = None if args.workdir else tempfile.mkdtemp(prefix="coral-gpu-engine-")
    workdir = args.workdir or Path(str(tmp))
    try:
        return run(size, str(device), workdir / "llama-3-8b-arch", args.out, args.clock)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def run(size: Size, device: str, model_dir: Path, out: Path, clock: str = "wall") -> dict[str, object]:
    t0 = time.perf_counter()
    ckpt = make_model(model_dir, size.spec)
    made_s = time.perf_counter() - t0
    n = size.spec.num_hidden_layers
    rng = random.Random(0)
    prompts = [[rng.randrange(7, size.spec.vocab_size) for _ in range(size.prompt - k)]
               for k in range(size.requests)]
    check = prompts[:4]
    cfg = EngineConfig(local=True, http=False, device=device, kv_cache_gib=size.kv_gib, max_batch=size.requests)
    results: dict[str, dict[str, object]] = {}
    outputs: dict[str, tuple[list[list[int]], list[torch.Tensor]]] = {}
    for name, layout in (("whole", Layout.of([n], [["whole"]])),
                         ("pipeline", Layout.of([n // 2, n - n // 2], [["s0"], ["s1"]]))):
        inst = CoralInstance(layout, ckpt, cfg).start()
        try:
            generate(inst, check[:1], 2, together=False)  # warm-up
            tokens, logits, _ = generate(inst, check, size.output, together=False)
            batched, _, _ = generate(inst, check, size.output, together=True)
            out_tokens, _, secs = generate(inst, prompts, size.output, together=True, logits=False)
        finally:
            inst.stop()
        outputs[name] = (tokens, logits)
        results[name] = {"output_tokens_per_s": sum(map(len, out_tokens)) / secs, "seconds": secs,
                         "batched_equals_sequential": batched == tokens}
    (whole_tokens, whole_logits), (pipe_tokens, pipe_logits) = outputs["whole"], outputs["pipeline"]
    pipeline_exact = pipe_tokens == whole_tokens and all(
        torch.equal(a, b) for a, b in zip(whole_logits, pipe_logits, strict=True))
    pipeline_rel = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(pipe_logits, whole_logits,
                                                                                   strict=True))
    reference = WholeModel(ckpt, device)
    ref = [(tokens, logits.float().cpu()) for tokens, logits in (reference.greedy(p, size.output) for p in check)]
    del reference
    agree = sum(r[0] == t for r, t in zip(ref, whole_tokens, strict=True))
    rel = max(float((lg - r[1]).abs().max() / r[1].abs().max()) for lg, r in zip(whole_logits, ref, strict=True))
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    architectures = architectures_check(device, model_dir.parent)
    rows = layer_profile(ckpt, size, device, CLOCKS[clock])
    config = gpu_config(device)
    write_profile(out, config, rows, size, clock)
    predicted = predicted_vs_measured(out, size)
    summary: dict[str, object] = {
        "device": device, "config": config, "layers": n, "hidden": size.spec.hidden_size,
        "model_written_s": made_s, "pipeline_exact_vs_whole": pipeline_exact,
        "pipeline_tokens_equal_whole": pipe_tokens == whole_tokens, "pipeline_max_rel_logit_diff": pipeline_rel,
        "transformers_token_agreement": f"{agree}/{len(check)}", "transformers_max_rel_logit_diff": rel,
        "throughput": results, "per_layer_ms": {str(p): r for p, r in rows.items()}, "profile_clock": clock,
        "perf_model_vs_measured": predicted, "architectures_exact_vs_transformers": architectures,
        "prompt": size.prompt, "output": size.output, "requests": size.requests,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_engine.json").write_text(stamped_json(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
