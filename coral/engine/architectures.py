"""What the engine's shard (`coral.engine.shard`) needs to know of each model architecture it serves.

Supported `model_type`s: llama, phi3 (phi-4: fused q|k|v and gate|up projections, partial rotary), qwen3
(per-head RMSNorm of queries and keys before RoPE), qwen3_moe (the same, with a top-k routed MoE MLP) and gpt_oss
(attention biases, per-head sinks, sliding-window layers, YaRN rope, a routed MoE of clamped SwiGLU experts with
biases). Each is built from its own `transformers` modules (decoder layer, RMSNorm, rotary embedding and RoPE
function); the shard computes attention itself over its paged KV pool, and uses everything else of the layer
(norms, projections, MLP or MoE) as `transformers` defines it.

Tensor parallelism splits every layer Megatron-style, exactly: the `Split` of each parameter says which of its
dimensions holds the features divided among ranks (heads for attention, intermediate features for MLPs and for
each expert of a MoE), and the modules of `REDUCED` have their output summed over the group. A parameter without a
rule is an error, not silently replicated.

Checkpoint tensors are read under the module's own names; expert weights are also read from the formats real
checkpoints use (`expert_tensor`): one Linear per expert (Qwen3-MoE), stacked here, or MXFP4 blocks and scales
(gpt-oss), dequantised here at load with `transformers`' own MXFP4 decoder.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Split:
    """How tensor parallelism divides one parameter of a layer. `dim`: the dimension whose features are divided
    (None: replicated). `parts`: the dimension stacks blocks, each divided in turn: 'qkv' (queries | keys |
    values), 'halves' (gate | up), 'pairs' (gate and up interleaved feature by feature). `rank0`: a row-parallel
    bias, added once: rank 0 keeps it, the others hold zeros."""

    dim: int | None = None
    parts: str = ""
    rank0: bool = False


REPLICATED = Split()
COLUMN, ROW, ROW_BIAS = Split(0), Split(1), Split(rank0=True)
# parameters of the layers of every architecture, by name within the decoder layer
COMMON_SPLITS = {
    "input_layernorm.weight": REPLICATED, "post_attention_layernorm.weight": REPLICATED,
    "self_attn.q_proj.weight": COLUMN, "self_attn.q_proj.bias": COLUMN,
    "self_attn.k_proj.weight": COLUMN, "self_attn.k_proj.bias": COLUMN,
    "self_attn.v_proj.weight": COLUMN, "self_attn.v_proj.bias": COLUMN,
    "self_attn.qkv_proj.weight": Split(0, "qkv"),
    "self_attn.o_proj.weight": ROW, "self_attn.o_proj.bias": ROW_BIAS,
    "self_attn.q_norm.weight": REPLICATED, "self_attn.k_norm.weight": REPLICATED,  # per head_dim
    "self_attn.sinks": COLUMN,  # one per query head
    "mlp.gate_proj.weight": COLUMN, "mlp.up_proj.weight": COLUMN, "mlp.down_proj.weight": ROW,
    "mlp.gate_up_proj.weight": Split(0, "halves"),
}
REDUCED = ("self_attn.o_proj", "mlp.down_proj", "mlp.experts")  # row-parallel: outputs summed over the group


@dataclass(frozen=True)
class Architecture:
    """One `model_type`: `prefix` names its `transformers` classes (`{prefix}DecoderLayer`, `{prefix}RMSNorm`,
    `{prefix}RotaryEmbedding`); `fused_qkv`: one `qkv_proj` gives queries, keys and values; `qk_norm`: queries
    and keys go through per-head RMSNorms (`q_norm`, `k_norm`) before RoPE; `splits`: the tensor-parallel rule
    of each layer parameter beyond `COMMON_SPLITS`."""

    model_type: str
    prefix: str
    fused_qkv: bool = False
    qk_norm: bool = False
    splits: dict[str, Split] = field(default_factory=dict)

    def _module(self) -> Any:
        return importlib.import_module(f"transformers.models.{self.model_type}.modeling_{self.model_type}")

    def layer(self, config: Any, index: int) -> nn.Module:
        return getattr(self._module(), f"{self.prefix}DecoderLayer")(config, layer_idx=index)

    def norm(self, config: Any) -> nn.Module:
        return getattr(self._module(), f"{self.prefix}RMSNorm")(config.hidden_size, eps=config.rms_norm_eps)

    def rotary(self, config: Any) -> nn.Module:
        return getattr(self._module(), f"{self.prefix}RotaryEmbedding")(config)

    @property
    def apply_rope(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        return self._module().apply_rotary_pos_emb

    def split(self, name: str) -> Split:
        rule = self.splits.get(name) or COMMON_SPLITS.get(name)
        if rule is None:
            raise ValueError(f"{self.model_type}: no tensor-parallel rule for layer parameter {name!r}")
        return rule


ARCHITECTURES = {a.model_type: a for a in (
    Architecture("llama", "Llama"),
    Architecture("phi3", "Phi3", fused_qkv=True),
    Architecture("qwen3", "Qwen3", qk_norm=True),
    Architecture("qwen3_moe", "Qwen3Moe", qk_norm=True, splits={
        "mlp.gate.weight": REPLICATED,  # the router
        "mlp.experts.gate_up_proj": Split(1, "halves"),  # (experts, gate | up features, hidden)
        "mlp.experts.down_proj": Split(2),  # (experts, hidden, features)
    }),
    Architecture("gpt_oss", "GptOss", splits={
        "mlp.router.weight": REPLICATED, "mlp.router.bias": REPLICATED,
        "mlp.experts.gate_up_proj": Split(2, "pairs"),  # (experts, hidden, gate/up interleaved)
        "mlp.experts.gate_up_proj_bias": Split(1, "pairs"),
        "mlp.experts.down_proj": Split(1),  # (experts, features, hidden)
        "mlp.experts.down_proj_bias": ROW_BIAS,
    }),
)}


def architecture(config: Any, where: object = "") -> Architecture:
    """The adapter of `config.model_type`; a ValueError naming it when the engine does not run it."""
    arch = ARCHITECTURES.get(config.model_type)
    if arch is None:
        raise ValueError(f"{where}: model_type {config.model_type!r} is not supported by the Coral engine "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    return arch


def sliding_window(config: Any, index: int) -> int | None:
    """Layer `index`'s attention window (a query at position p sees keys at positions > p - window), or None: from
    `layer_types` where the config has them, else the config's `sliding_window` for every layer."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if types[index] == "sliding_attention" else None
    return window


def shard_tensor(t: torch.Tensor, rule: Split, rank: int, size: int, qkv: list[int], name: str) -> torch.Tensor:
    """Rank `rank`'s share (of `size`) of parameter `name` under `rule`; `qkv`: sizes of the query, key and value
    blocks of a fused projection."""
    if rule.rank0:
        return t if rank == 0 else torch.zeros_like(t)
    if rule.dim is None:
        return t
    dim = rule.dim
    if rule.parts == "pairs":
        t = t.unflatten(dim, (-1, 2))
    parts = t.split(qkv, dim) if rule.parts == "qkv" else t.chunk(2 if rule.parts == "halves" else 1, dim)
    for p in parts:
        if p.shape[dim] % size:
            raise ValueError(f"tensor parallelism {size}: {name} has {p.shape[dim]} features along dimension "
                             f"{dim}, not divisible")
    out = torch.cat([p.chunk(size, dim)[rank] for p in parts], dim)
    return out.flatten(dim, dim + 1) if rule.parts == "pairs" else out


def expert_tensor(name: str, keys: Container[str], get: Callable[[str], torch.Tensor],
                  dtype: torch.dtype) -> torch.Tensor | None:
    """Checkpoint tensor for the fused expert parameter `name` (`...mlp.experts.gate_up_proj` or `down_proj`)
    when the checkpoint stores it otherwise: MXFP4 `{name}_blocks` and `{name}_scales` (gpt-oss), dequantised to
    `dtype`; or one Linear per expert (`...experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`), stacked. None:
    neither is there."""
    if f"{name}_blocks" in keys:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        return convert_moe_packed_tensors(get(f"{name}_blocks"), get(f"{name}_scales"), dtype=dtype)
    m = re.fullmatch(r"(.*\.experts)\.(gate_up_proj|down_proj)", name)
    if m is None or f"{m[1]}.0.down_proj.weight" not in keys:
        return None
    base, proj = m[1], m[2]
    count = 0
    while f"{base}.{count}.down_proj.weight" in keys:
        count += 1
    if proj == "down_proj":
        return torch.stack([get(f"{base}.{e}.down_proj.weight") for e in range(count)])
    return torch.stack([torch.cat([get(f"{base}.{e}.gate_proj.weight"), get(f"{base}.{e}.up_proj.weight")])
                        for e in range(count)])
