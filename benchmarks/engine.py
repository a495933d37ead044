"""Benchmark the Coral pipeline engine on this machine (real node processes, gloo activations).

    python benchmarks/engine.py [--requests 24] [--prompt 32] [--output 32] [--layers 8] [--hidden 512]

1. Throughput: a heterogeneous pipelined instance (2 stages, 2 data-parallel nodes in the first, uneven layers
   5 | 3) against the same 3 nodes run as 3 independent whole-model replicas, on `--requests` concurrent
   requests (output tokens/s, wall clock from first submit to last token).
2. Overhead per stage hop: the inter-token latency of one request on 1, 2 and 4 stages of the same model; the
   slope (ms per extra stage) is the engine's cost of a hop (control message, activation transfer, scheduling).

Each node process runs torch with 1 thread; on a 2-core machine the 3 node processes (and this driver)
compete for cores, so figures are for comparing layouts on the same machine, not absolute capacity.
Prints a table and writes out/benchmarks/engine.json.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from coral.engine.instance import CoralInstance, EngineConfig
from coral.engine.layout import Layout
from coral.engine.scheduler import Request
from coral.engine.tiny_model import TinyLlamaSpec, make_tiny_llama


def drive(instances: list[CoralInstance], prompts: list[list[int]], output: int) -> tuple[float, int]:
    """Submit every prompt at once (round-robin over `instances`); (seconds until the last token, tokens)."""
    finished = threading.Semaphore(0)
    count = [0]
    lock = threading.Lock()

    def on_event(token: int | None, finish: str | None, _logits: list[float] | None) -> None:
        with lock:
            count[0] += token is not None
        if finish is not None:
            finished.release()

    start = time.perf_counter()
    for i, p in enumerate(prompts):
        sched = instances[i % len(instances)].scheduler
        assert sched is not None
        sched.submit(Request(rid=f"b{i}", prompt=p, max_tokens=output, on_event=on_event))
    for _ in prompts:
        if not finished.acquire(timeout=600):
            raise TimeoutError("benchmark requests did not finish")
    return time.perf_counter() - start, count[0]


def itl_ms(inst: CoralInstance, prompt: list[int], output: int) -> float:
    """Mean inter-token latency of one request alone (ms), prefill excluded."""
    times: list[float] = []
    done = threading.Event()

    def on_event(token: int | None, finish: str | None, _logits: list[float] | None) -> None:
        times.append(time.perf_counter())
        if finish is not None:
            done.set()

    assert inst.scheduler is not None
    inst.scheduler.submit(Request(rid=f"itl{time.monotonic_ns()}", prompt=prompt, max_tokens=output,
                                  on_event=on_event))
    if not done.wait(600):
        raise TimeoutError("latency request did not finish")
    return 1e3 * (times[-1] - times[0]) / (len(times) - 1)


def started(layout: Layout, ckpt: Path) -> CoralInstance:
    return CoralInstance(layout, ckpt, EngineConfig(http=False)).start()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--out", type=Path, default=Path("out/benchmarks"))
    args = ap.parse_args()
    console = Console()
    spec = TinyLlamaSpec(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_attention_heads=8, num_key_value_heads=4, initializer_range=0.25)
    rng = random.Random(0)
    prompts = [[rng.randrange(7, spec.vocab_size) for _ in range(args.prompt)] for _ in range(args.requests)]
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_llama(Path(tmp) / "bench-model", spec)
        first = (5 * args.layers) // 8
        layouts = {
            "pipeline 2 stages, 2+1 nodes": [Layout.of([first, args.layers - first], [["L4", "A10G"], ["L40S"]],
                                                       [[1.0, 1.0], [2.0]])],
            "3 independent replicas": [Layout.of([args.layers], [[name]], instance_id=name)
                                       for name in ("L4", "A10G", "L40S")],
        }
        for name, lays in layouts.items():
            console.print(f"[dim]starting {name} ...[/]")
            insts = [started(lay, ckpt) for lay in lays]
            try:
                drive(insts, prompts[:2], 2)  # warm-up
                secs, tokens = drive(insts, prompts, args.output)
            finally:
                for inst in insts:
                    inst.stop()
            results[name] = {"seconds": secs, "output_tokens": tokens, "tokens_per_s": tokens / secs}
        hops: dict[int, float] = {}
        for stages in (1, 2, 4):
            split = [args.layers // stages] * stages
            split[-1] += args.layers - sum(split)
            console.print(f"[dim]starting {stages}-stage instance ...[/]")
            inst = started(Layout.of(split, [[f"n{s}"] for s in range(stages)]), ckpt)
            try:
                itl_ms(inst, prompts[0], 4)  # warm-up
                hops[stages] = min(itl_ms(inst, prompts[0], args.output) for _ in range(3))
            finally:
                inst.stop()
    per_hop = (hops[4] - hops[1]) / 3
    table = Table("layout", "output tok/s", "seconds", title=f"{args.requests} requests, {args.prompt} in / "
                  f"{args.output} out, {args.layers} layers x {args.hidden}")
    for name, r in results.items():
        table.add_row(name, f"{r['tokens_per_s']:.0f}", f"{r['seconds']:.2f}")
    console.print(table)
    lat = Table("stages", "inter-token latency (ms)", title="one request alone")
    for stages, ms in hops.items():
        lat.add_row(str(stages), f"{ms:.2f}")
    console.print(lat)
    console.print(f"overhead per stage hop: [bold]{per_hop:.2f} ms[/] (slope from 1 to 4 stages)")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "engine.json"
    path.write_text(json.dumps({
        "config": vars(args) | {"out": str(args.out)},
        "throughput": results,
        "itl_ms_by_stages": hops,
        "overhead_ms_per_hop": per_hop,
        "threads_per_node": 1,
    }, indent=2))
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
