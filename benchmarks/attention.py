"""Paged attention of one micro-batch: one call per kind of step (`coral.engine.attention`) against one
`scaled_dot_product_attention` call per request (the engine's previous loop), on the same pool and queries.

    python benchmarks/attention.py [--device cpu|cuda] [--rounds 5] [--threads 1] [--out out/benchmarks]

Cases (one layer; the geometry, built once per micro-batch and shared by every layer, is timed apart): decode batches of 1-128 requests with contexts drawn from [context/4, context], and a mixed
batch (decode steps plus two prefill chunks). Heads as Llama-3-8B's on a GPU (32 query / 8 KV heads of 128),
the tiny engine model's on the CPU (8 / 4 heads of 64). Both ways are timed in alternation, fastest of
`--rounds`, with `--threads` torch threads (1, as an engine node runs on a CPU); the outputs are compared. Prints a table and writes `<out>/attention.json`.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from _console import stamped_json, table_console  # benchmarks/_console.py
from rich.table import Table
from torch.nn.functional import scaled_dot_product_attention

from coral.engine.attention import AttentionBatch


def per_request(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: list[int], counts: list[int],
                slots: list[torch.Tensor], scale: float) -> torch.Tensor:
    """The previous way: gather each request's KV and call SDPA for it alone."""
    out = torch.empty_like(q)
    at = 0
    for start, n, sl in zip(starts, counts, slots, strict=True):
        keys = k.index_select(0, sl).transpose(0, 1).unsqueeze(0)
        values = v.index_select(0, sl).transpose(0, 1).unsqueeze(0)
        mask = None if start == 0 or n == 1 else torch.ones(n, start + n, dtype=torch.bool,
                                                             device=q.device).tril(start)
        res = scaled_dot_product_attention(q[at:at + n].transpose(0, 1).unsqueeze(0), keys, values,
                                           attn_mask=mask, is_causal=start == 0 and n > 1, scale=scale,
                                           enable_gqa=True)
        out[at:at + n] = res[0].transpose(0, 1)
        at += n
    return out


def timed(fn: object, device: torch.device) -> float:
    assert callable(fn)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t


def case(name: str, starts: list[int], counts: list[int], heads: int, kv_heads: int, dim: int,
         device: torch.device, dtype: torch.dtype, rounds: int) -> dict[str, float | str | int]:
    total = sum(s + n for s, n in zip(starts, counts, strict=True))
    gen = torch.Generator(device="cpu").manual_seed(0)
    k = torch.randn(total + 64, kv_heads, dim, generator=gen).to(device, dtype)
    v = torch.randn(total + 64, kv_heads, dim, generator=gen).to(device, dtype)
    perm = torch.randperm(total + 64, generator=gen).to(device)
    slots, used = [], 0
    for s, n in zip(starts, counts, strict=True):
        slots.append(perm[used:used + s + n])
        used += s + n
    q = torch.randn(sum(counts), heads, dim, generator=gen).to(device, dtype)
    scale = dim ** -0.5

    def build() -> AttentionBatch:
        return AttentionBatch.build(starts, counts, slots, device)

    geometry = build()

    def batched() -> torch.Tensor:
        return geometry.attend(q, k, v, scale)

    def looped() -> torch.Tensor:
        return per_request(q, k, v, starts, counts, slots, scale)

    diff = float((batched().float() - looped().float()).abs().max())
    best = {"batched": float("inf"), "per_request": float("inf"), "build": float("inf")}
    for _ in range(rounds):
        best["build"] = min(best["build"], timed(build, device))
        best["batched"] = min(best["batched"], timed(batched, device))
        best["per_request"] = min(best["per_request"], timed(looped, device))
    return {"case": name, "requests": len(starts), "query_tokens": sum(counts), "key_tokens": total,
            "sdpa_calls": len(geometry.groups), "build_ms": 1e3 * best["build"],
            "batched_ms": 1e3 * best["batched"], "per_request_ms": 1e3 * best["per_request"],
            "speedup": best["per_request"] / best["batched"], "max_abs_diff": diff}


def main(argv: list[str] | None = None) -> list[dict[str, float | str | int]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (an engine node on a CPU uses 1)")
    ap.add_argument("--out", type=Path, default=Path("out/benchmarks"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    heads, kv_heads, dim = (32, 8, 128) if gpu else (8, 4, 64)
    dtype = torch.bfloat16 if gpu else torch.float32
    context = 4096 if gpu else 1024
    rng = random.Random(0)
    rows = []
    for batch in (1, 8, 32, 128):
        starts = [rng.randint(context // 4, context) for _ in range(batch)]
        rows.append(case(f"decode x{batch}", starts, [1] * batch, heads, kv_heads, dim, device, dtype, args.rounds))
    starts = [rng.randint(context // 4, context) for _ in range(30)] + [0, context // 2]
    counts = [1] * 30 + [context // 8, context // 8]
    rows.append(case("30 decode + 2 prefill chunks", starts, counts, heads, kv_heads, dim, device, dtype,
                     args.rounds))
    name = torch.cuda.get_device_name(device) if gpu else "CPU"
    table = Table("case", "requests", "query tok", "key tok", "per-request ms", "batched ms", "SDPA calls",
                  "speedup", "geometry ms (once per batch)", "max |diff|",
                  title=f"paged attention, one layer, {name}, {heads}/{kv_heads} heads x {dim}, "
                  f"{str(dtype).removeprefix('torch.')}, {args.threads} thread(s), fastest of {args.rounds}")
    for r in rows:
        table.add_row(str(r["case"]), str(r["requests"]), str(r["query_tokens"]), str(r["key_tokens"]),
                      f"{r['per_request_ms']:.3f}", f"{r['batched_ms']:.3f}", str(r["sdpa_calls"]),
                      f"{r['speedup']:.2f}", f"{r['build_ms']:.3f}", f"{r['max_abs_diff']:.1e}")
    table_console(pipe_width=140).print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"attention-{device.type}.json"
    path.write_text(stamped_json({"device": name, "dtype": str(dtype), "heads": [heads, kv_heads, dim],
                                "threads": args.threads, "rows": rows}, indent=2))
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
