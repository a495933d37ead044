"""A node's model shard: decoder layers [first, last) of a Hugging Face checkpoint, built from `transformers`' own
modules of its architecture (embedding on the first stage, final norm and lm_head on the last) with only the
shard's tensors read from the safetensors files, and a paged KV cache (`KVPool`).

Architectures (`coral.engine.architectures`): llama, phi3 (phi-4), qwen3, qwen3_moe and gpt_oss, each with
pipeline stages, data-parallel nodes, tensor parallelism (MoE experts split by intermediate features) and the KV
hand-off between instances; another `model_type` is refused with a message naming it. gpt-oss experts stored in
MXFP4 are dequantised at load to the checkpoint's dtype.

A micro-batch runs as one flattened batch of tokens (prefill chunks and decode steps of different requests,
variable length, no padding): norms, q/k/v/o projections, rotary embedding and MLP or MoE see (tokens, hidden)
matrices; attention runs over the requests' KV in the pool, per layer with its sliding window and sinks if any
(`coral.engine.attention.AttentionBatch`).
"""

from __future__ import annotations

import itertools
import json
import math
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig

from coral.engine.architectures import REDUCED, architecture, expert_tensor, shard_tensor, sliding_window
from coral.engine.attention import AttentionBatch

KV = tuple[torch.Tensor, torch.Tensor]  # keys and values, (1, kv_heads, tokens, head_dim)


class AllReduced(nn.Module):
    """A row-parallel module (a projection, or a MoE's experts): the local partial output, summed over the
    tensor-parallel group."""

    def __init__(self, inner: nn.Module, group: Any) -> None:
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, *args: Any) -> torch.Tensor:
        y: torch.Tensor = self.inner(*args)
        dist.all_reduce(y, group=self.group)
        return y


class PoolFull(RuntimeError):
    """The KV pool has no free block for a request (the scheduler's accounting should prevent it)."""


@dataclass(frozen=True)
class Step:
    """One request's share of a micro-batch: `n` new tokens from position `start`; `sample`: the last stage
    returns logits for its last token (the final chunk of a prefill, or a decode step)."""

    rid: str
    start: int
    n: int
    sample: bool = True


class KVPool:
    """The paged KV cache of one shard: keys and values of every local layer in `blocks` fixed-size blocks of
    `block_size` token slots, preallocated; each request holds a block table (its blocks, in token order).
    A block holds the request's tokens on all of the shard's layers, so blocks are freed when all layers are
    released."""

    def __init__(self, layers: int, blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        if blocks < 1 or block_size < 1:
            raise ValueError(f"KV pool: {blocks} blocks of {block_size} tokens; needs at least one block")
        self.blocks, self.block_size = blocks, block_size
        shape = (layers, blocks * block_size, kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)  # on a CPU, pages are committed when written
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.free_blocks = list(range(blocks - 1, -1, -1))  # popped from the end: lowest ids first
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, int] = {}  # tokens whose KV is written, per request

    @staticmethod
    def bytes_per_block(layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    @property
    def used(self) -> int:
        return self.blocks - len(self.free_blocks)

    def reserve(self, rid: str, tokens: int) -> None:
        """Grow `rid`'s block table to hold `tokens` tokens."""
        table = self.tables.setdefault(rid, [])
        need = self.blocks_for(tokens) - len(table)
        if need > len(self.free_blocks):
            raise PoolFull(f"request {rid}: {need} more KV blocks needed, {len(self.free_blocks)} free")
        table.extend(self.free_blocks.pop() for _ in range(max(need, 0)))
        self.tokens.setdefault(rid, 0)

    def slots(self, rid: str, start: int, stop: int) -> torch.Tensor:
        """Pool slots of `rid`'s tokens [start, stop)."""
        table = torch.tensor(self.tables[rid], dtype=torch.long, device=self.k.device)
        pos = torch.arange(start, stop, device=self.k.device)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def release(self, rid: str) -> None:
        self.free_blocks.extend(reversed(self.tables.pop(rid, [])))
        self.tokens.pop(rid, None)


def free_memory(device: torch.device) -> int:
    """Bytes free on `device`: the CUDA driver's figure, or the host's MemAvailable."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo: give the KV pool in GiB (kv_cache_gib)")


def checkpoint_layers(checkpoint: str | Path) -> int:
    """Number of decoder layers of a checkpoint (from its config)."""
    return int(AutoConfig.from_pretrained(checkpoint).num_hidden_layers)


def _tensor_files(checkpoint: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file (single file or sharded with an index)."""
    index = checkpoint / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: checkpoint / fname for name, fname in weight_map.items()}
    single = checkpoint / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{checkpoint}: no model.safetensors(.index.json)")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


class Shard(nn.Module):
    """Layers [first, last) of `checkpoint` on `device`; `embed` and `head` present on the first/last stage.

    With a tensor-parallel `tp_group` of size t, each rank keeps 1/t of the attention heads (query and KV, and
    their sinks) and of the intermediate features of the MLP or of every expert, Megatron-style (the rules:
    `coral.engine.architectures.Split`): column-parallel projections split by output features, row-parallel
    ones (o_proj, down_proj, the experts) by input features and summed over the group (`AllReduced`);
    embedding, norms, routers and lm_head are replicated. The KV cache of a rank holds its heads only.

    The KV pool gets `kv_blocks` blocks of `block_size` tokens, or (`kv_blocks` 0) as many as fit in
    `kv_cache_fraction` of the device's free memory once the weights are loaded (if > 0), else in `kv_cache_gib`
    GiB."""

    def __init__(self, checkpoint: str | Path, first: int, last: int, device: str = "cpu",
                 tp_group: Any = None, kv_cache_gib: float = 0.25, block_size: int = 16,
                 kv_blocks: int = 0, kv_cache_fraction: float = 0.0) -> None:
        super().__init__()
        checkpoint = Path(checkpoint)
        config: Any = AutoConfig.from_pretrained(checkpoint)
        self.arch = architecture(config, checkpoint)
        config._experts_implementation = "grouped_mm"  # what transformers runs a loaded MoE model with
        n = int(config.num_hidden_layers)
        if not 0 <= first < last <= n:
            raise ValueError(f"layers [{first}, {last}): must be a non-empty range within the model's {n} layers")
        self.config, self.first, self.last, self.device = config, first, last, torch.device(device)
        self.is_first, self.is_last = first == 0, last == n
        dtype = getattr(config, "dtype", None) or torch.float32
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        with torch.device("meta"):
            self.layers = nn.ModuleList(self.arch.layer(config, i) for i in range(first, last))
            self.embed = nn.Embedding(config.vocab_size, config.hidden_size) if self.is_first else None
            self.norm = self.arch.norm(config) if self.is_last else None
            self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) if self.is_last else None
        self.rotary = self.arch.rotary(config).to(self.device)
        self.windows = [sliding_window(config, i) for i in range(first, last)]
        self.tp_rank, self.tp_size = (dist.get_rank(tp_group), dist.get_world_size(tp_group)) if tp_group else (0, 1)
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads or config.num_attention_heads)
        if heads % self.tp_size or kv_heads % self.tp_size:
            raise ValueError(f"{checkpoint}: tensor parallelism {self.tp_size} does not divide the model's {heads} "
                             f"attention heads and {kv_heads} KV heads")
        self._load(checkpoint)
        if self.tp_size > 1:
            self._split(tp_group, [heads * self.head_dim, kv_heads * self.head_dim, kv_heads * self.head_dim])
        heads, kv_heads = heads // self.tp_size, kv_heads // self.tp_size
        self.qkv_sizes = [heads * self.head_dim, kv_heads * self.head_dim, kv_heads * self.head_dim]
        self.eval()
        per_block = KVPool.bytes_per_block(last - first, block_size, kv_heads, self.head_dim, self.dtype)
        budget = kv_cache_fraction * free_memory(self.device) if kv_cache_fraction > 0 else kv_cache_gib * 2**30
        blocks = kv_blocks or int(budget) // per_block
        self.pool = KVPool(last - first, blocks, block_size, kv_heads, self.head_dim, self.dtype, self.device)
        self.exported: dict[str, set[int]] = {}  # request -> layers handed off so far (blocks freed when all are)

    def _split(self, group: Any, qkv: list[int]) -> None:
        """Keep this rank's share of every layer parameter; sum row-parallel outputs over the group."""
        for layer in self.layers:
            for name, param in list(layer.named_parameters()):
                owner, _, attr = name.rpartition(".")
                part = shard_tensor(param.data, self.arch.split(name), self.tp_rank, self.tp_size, qkv, name)
                setattr(layer.get_submodule(owner), attr, nn.Parameter(part.clone(), requires_grad=False))
            for path in REDUCED:
                owner, _, attr = path.rpartition(".")
                module = getattr(layer.get_submodule(owner), attr, None)
                if module is not None:
                    setattr(layer.get_submodule(owner), attr, AllReduced(module, group))

    def _load(self, checkpoint: Path) -> None:
        """Read only this shard's tensors (checkpoint names mapped to the shard's module names; expert weights
        stacked or dequantised from the checkpoint's format, see `expert_tensor`)."""
        wanted: dict[str, str] = {}
        for j, i in enumerate(range(self.first, self.last)):
            for name in self.layers[j].state_dict():
                wanted[f"model.layers.{i}.{name}"] = f"layers.{j}.{name}"
        if self.is_first:
            wanted["model.embed_tokens.weight"] = "embed.weight"
        if self.is_last:
            wanted["model.norm.weight"] = "norm.weight"
            tied = bool(getattr(self.config, "tie_word_embeddings", False))
            wanted["model.embed_tokens.weight" if tied else "lm_head.weight"] = "head.weight"
        files = _tensor_files(checkpoint)
        state: dict[str, torch.Tensor] = {}
        missing: list[str] = []
        with ExitStack() as stack:
            opened: dict[Path, Any] = {}

            def get(name: str) -> torch.Tensor:
                path = files[name]
                if path not in opened:
                    opened[path] = stack.enter_context(safe_open(path, framework="pt", device=str(self.device)))
                return opened[path].get_tensor(name)

            for name, target in wanted.items():
                tensor = get(name) if name in files else expert_tensor(name, files, get, self.dtype)
                if tensor is None:
                    missing.append(name)
                else:
                    state[target] = tensor.to(self.dtype)
        if missing:
            raise KeyError(f"{checkpoint}: tensors missing from the checkpoint: {missing[:5]}")
        if self.is_first and self.is_last and "embed.weight" not in state:
            state["embed.weight"] = state["head.weight"]
        self.load_state_dict(state, strict=True, assign=True)

    def _qkv(self, att: Any, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values (tokens, heads, head_dim) of the normed hidden states `y`, before RoPE."""
        if self.arch.fused_qkv:
            q, k, v = att.qkv_proj(y).split(self.qkv_sizes, -1)
        else:
            q, k, v = att.q_proj(y), att.k_proj(y), att.v_proj(y)
        q, k, v = (t.reshape(len(y), -1, self.head_dim) for t in (q, k, v))
        if self.arch.qk_norm:
            q, k = att.q_norm(q), att.k_norm(k)
        return q, k, v

    @torch.inference_mode()
    def forward_batch(self, steps: list[Step], x: torch.Tensor) -> torch.Tensor:
        """Run a micro-batch through the shard: `x` is the steps' new token ids (tokens,) on the first stage,
        their hidden states (tokens, hidden) otherwise, concatenated in step order. Each request's KV holds
        exactly `start` tokens before its step (its blocks are reserved here). Returns hidden states
        (tokens, hidden), or on the last stage the logits (sampled steps, vocab) of each sampled step's last
        token."""
        pool = self.pool
        for s in steps:
            held = pool.tokens.get(s.rid, 0)
            if held != s.start:
                raise RuntimeError(f"request {s.rid}: KV holds {held} tokens on layers "
                                   f"[{self.first}, {self.last}), the step starts at position {s.start}")
            pool.reserve(s.rid, s.start + s.n)
        h = self.embed(x.to(self.device)) if self.embed is not None else x.to(self.device, self.dtype)
        positions = torch.cat([torch.arange(s.start, s.start + s.n, device=self.device) for s in steps])
        cos, sin = self.rotary(h, positions.unsqueeze(0))
        slots = [pool.slots(s.rid, 0, s.start + s.n) for s in steps]
        new_slots = torch.cat([sl[s.start:] for s, sl in zip(steps, slots, strict=True)])
        batch = AttentionBatch.build([s.start for s in steps], [s.n for s in steps], slots, self.device)
        for j, decoder in enumerate(self.layers):
            layer: Any = decoder
            att: Any = layer.self_attn
            q, k, v = self._qkv(att, layer.input_layernorm(h))
            q, k = self.arch.apply_rope(q, k, cos[0], sin[0], unsqueeze_dim=1)
            pool.k[j].index_copy_(0, new_slots, k)
            pool.v[j].index_copy_(0, new_slots, v)
            out = batch.attend(q, pool.k[j], pool.v[j], att.scaling, self.windows[j], getattr(att, "sinks", None))
            h = h + att.o_proj(out.reshape(len(h), -1))
            mlp = layer.mlp(layer.post_attention_layernorm(h).unsqueeze(0))  # MoE blocks want (batch, tokens, hidden)
            h = h + (mlp[0] if isinstance(mlp, tuple) else mlp)[0]  # gpt-oss's MoE also returns its router scores
        for s in steps:
            pool.tokens[s.rid] = s.start + s.n
        if self.norm is None or self.head is None:
            return h
        ends = itertools.accumulate(s.n for s in steps)
        last = torch.tensor([e - 1 for s, e in zip(steps, ends, strict=True) if s.sample],
                            dtype=torch.long, device=self.device)
        return self.head(self.norm(h.index_select(0, last))).float()

    def holds(self, rid: str) -> bool:
        return rid in self.pool.tables

    def export_kv(self, rid: str, first: int, last: int) -> dict[int, KV]:
        """Remove and return the KV of layers [first, last) of request `rid`, as (1, kv_heads, tokens,
        head_dim) tensors; its blocks are freed once every layer of the shard is handed off."""
        layers = range(max(first, self.first), min(last, self.last))
        if not self.holds(rid) or self.exported.get(rid, set()) & set(layers):
            raise KeyError(f"request {rid}: no KV on layers [{self.first}, {self.last})")
        slots = self.pool.slots(rid, 0, self.pool.tokens[rid])
        out = {i: (self.pool.k[i - self.first].index_select(0, slots).transpose(0, 1).unsqueeze(0),
                   self.pool.v[i - self.first].index_select(0, slots).transpose(0, 1).unsqueeze(0))
               for i in layers}
        done = self.exported.setdefault(rid, set())
        done.update(layers)
        if len(done) == self.last - self.first:
            self.free(rid)
        return out

    def import_kv(self, rid: str, layers: dict[int, KV]) -> None:
        """Install KV received for request `rid` (every layer of the shard), all heads (a tensor-parallel rank
        keeps its own); layers outside the shard are an error."""
        if self.tp_size > 1:
            layers = {i: (k.chunk(self.tp_size, 1)[self.tp_rank], v.chunk(self.tp_size, 1)[self.tp_rank])
                      for i, (k, v) in layers.items()}
        outside = [i for i in layers if not self.first <= i < self.last]
        if outside:
            raise ValueError(f"request {rid}: layers {outside} are not on shard [{self.first}, {self.last})")
        tokens = next(iter(layers.values()))[0].shape[-2]
        self.pool.reserve(rid, tokens)
        slots = self.pool.slots(rid, 0, tokens)
        for i, (k, v) in layers.items():
            self.pool.k[i - self.first].index_copy_(0, slots, k[0].transpose(0, 1).to(self.device, self.dtype))
            self.pool.v[i - self.first].index_copy_(0, slots, v[0].transpose(0, 1).to(self.device, self.dtype))
        self.pool.tokens[rid] = tokens

    def free(self, rid: str) -> None:
        self.pool.release(rid)
        self.exported.pop(rid, None)
