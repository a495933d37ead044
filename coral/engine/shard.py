"""A node's model shard: decoder layers [first, last) of a Hugging Face Llama-family checkpoint, built from
`transformers`' own modules (embedding on the first stage, final norm and lm_head on the last) with only the
shard's tensors read from the safetensors files, and a per-request KV cache per layer.

Requests of a micro-batch run one after another through the shard (attention, projections and MLP per request),
so a request's arithmetic is exactly that of the same model run whole on that request alone: batching happens at
the scheduling level (one control message, one activation transfer and one KV lifetime per micro-batch), never by
padding sequences together.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

KV = tuple[torch.Tensor, torch.Tensor]  # keys and values, (1, kv_heads, tokens, head_dim)


class AllReduced(nn.Module):
    """A row-parallel projection: the local partial product, summed over the tensor-parallel group."""

    def __init__(self, inner: nn.Linear, group: Any) -> None:
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        dist.all_reduce(y, group=self.group)
        return y


def _keep_rows(lin: nn.Linear, rank: int, size: int) -> None:
    """Column parallel: this rank's share of the output features."""
    lin.weight = nn.Parameter(lin.weight.chunk(size, 0)[rank].clone(), requires_grad=False)
    if lin.bias is not None:
        lin.bias = nn.Parameter(lin.bias.chunk(size, 0)[rank].clone(), requires_grad=False)


def _keep_cols(lin: nn.Linear, rank: int, size: int) -> None:
    """Row parallel: this rank's share of the input features (the bias is added once, by rank 0)."""
    lin.weight = nn.Parameter(lin.weight.chunk(size, 1)[rank].clone(), requires_grad=False)
    if lin.bias is not None and rank:
        lin.bias = nn.Parameter(torch.zeros_like(lin.bias), requires_grad=False)


@dataclass
class RequestKV:
    """The KV of one request on one shard, by global layer index. Duck-types the `update` of a transformers
    `Cache`, which is all the attention modules call."""

    layers: dict[int, KV] = field(default_factory=dict)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *_: Any, **__: Any) -> KV:
        old = self.layers.get(layer_idx)
        if old is not None:
            key, value = torch.cat([old[0], key], dim=-2), torch.cat([old[1], value], dim=-2)
        self.layers[layer_idx] = (key, value)
        return key, value

    @property
    def tokens(self) -> int:
        return next(iter(self.layers.values()))[0].shape[-2] if self.layers else 0


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

    With a tensor-parallel `tp_group` of size t, each rank keeps 1/t of the attention heads (query and KV) and of
    the MLP's intermediate features, Megatron-style: q/k/v/gate/up split by output features, o/down by input
    features and summed over the group (`AllReduced`); embedding, norms and lm_head are replicated. The KV
    cache of a rank holds its heads only."""

    def __init__(self, checkpoint: str | Path, first: int, last: int, device: str = "cpu",
                 tp_group: Any = None) -> None:
        super().__init__()
        checkpoint = Path(checkpoint)
        config: LlamaConfig = AutoConfig.from_pretrained(checkpoint)
        if config.model_type != "llama":
            raise ValueError(f"{checkpoint}: model_type {config.model_type!r}; the engine runs Llama checkpoints")
        config._attn_implementation = "sdpa"
        n = int(config.num_hidden_layers)
        if not 0 <= first < last <= n:
            raise ValueError(f"layers [{first}, {last}): must be a non-empty range within the model's {n} layers")
        self.config, self.first, self.last, self.device = config, first, last, torch.device(device)
        self.is_first, self.is_last = first == 0, last == n
        dtype = getattr(config, "dtype", None) or torch.float32
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        with torch.device("meta"):
            self.layers = nn.ModuleList(LlamaDecoderLayer(config, layer_idx=i) for i in range(first, last))
            self.embed = nn.Embedding(config.vocab_size, config.hidden_size) if self.is_first else None
            self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps) if self.is_last else None
            self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) if self.is_last else None
        self.rotary = LlamaRotaryEmbedding(config).to(self.device)
        self._load(checkpoint)
        self.tp_rank, self.tp_size = (dist.get_rank(tp_group), dist.get_world_size(tp_group)) if tp_group else (0, 1)
        if self.tp_size > 1:
            for layer in self.layers:
                att: Any = layer.self_attn
                mlp: Any = layer.mlp
                for lin in (att.q_proj, att.k_proj, att.v_proj, mlp.gate_proj, mlp.up_proj):
                    _keep_rows(lin, self.tp_rank, self.tp_size)
                for lin in (att.o_proj, mlp.down_proj):
                    _keep_cols(lin, self.tp_rank, self.tp_size)
                att.o_proj, mlp.down_proj = AllReduced(att.o_proj, tp_group), AllReduced(mlp.down_proj, tp_group)
        self.eval()
        params = inspect.signature(LlamaDecoderLayer.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.kv: dict[str, RequestKV] = {}

    def _load(self, checkpoint: Path) -> None:
        """Read only this shard's tensors (checkpoint names mapped to the shard's module names)."""
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
        missing = [k for k in wanted if k not in files]
        if missing:
            raise KeyError(f"{checkpoint}: tensors missing from the checkpoint: {missing[:5]}")
        state: dict[str, torch.Tensor] = {}
        by_file: dict[Path, list[str]] = {}
        for k in wanted:
            by_file.setdefault(files[k], []).append(k)
        for path, names in by_file.items():
            with safe_open(path, framework="pt", device=str(self.device)) as f:
                for k in names:
                    state[wanted[k]] = f.get_tensor(k).to(self.dtype)
        if self.is_first and self.is_last and "embed.weight" not in state:
            state["embed.weight"] = state["head.weight"]
        self.load_state_dict(state, strict=True, assign=True)

    @torch.inference_mode()
    def forward_request(self, rid: str, x: torch.Tensor, start: int) -> torch.Tensor:
        """Run one request's new tokens through the shard: `x` is token ids (n,) on the first stage, hidden
        states (n, hidden) otherwise; `start` is the position of the first new token. The request's KV grows.
        Returns hidden states (n, hidden), or the last position's logits (vocab,) on the last stage."""
        kv = self.kv.setdefault(rid, RequestKV())
        if kv.tokens != start:
            raise RuntimeError(f"request {rid}: KV holds {kv.tokens} tokens on layers "
                               f"[{self.first}, {self.last}), the step starts at position {start}")
        h = self.embed(x.to(self.device)) if self.embed is not None else x.to(self.device, self.dtype)
        h = h.unsqueeze(0)
        positions = torch.arange(start, start + h.shape[1], device=self.device).unsqueeze(0)
        rope = self.rotary(h, positions)
        for layer in self.layers:
            out = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rope, use_cache=True,
                        **{self._cache_kwarg: kv})
            h = out[0] if isinstance(out, tuple) else out
        if self.norm is None or self.head is None:
            return h[0]
        return self.head(self.norm(h[:, -1:]))[0, 0].float()

    def export_kv(self, rid: str, first: int, last: int) -> dict[int, KV]:
        """Remove and return the KV of layers [first, last) of request `rid` (the rest stays)."""
        kv = self.kv.get(rid)
        if kv is None:
            raise KeyError(f"request {rid}: no KV on layers [{self.first}, {self.last})")
        out = {i: kv.layers.pop(i) for i in range(max(first, self.first), min(last, self.last))}
        if not kv.layers:
            del self.kv[rid]
        return out

    def import_kv(self, rid: str, layers: dict[int, KV]) -> None:
        """Install KV received for request `rid`, all heads (a tensor-parallel rank keeps its own); layers outside
        the shard are an error."""
        if self.tp_size > 1:
            layers = {i: (k.chunk(self.tp_size, 1)[self.tp_rank], v.chunk(self.tp_size, 1)[self.tp_rank])
                      for i, (k, v) in layers.items()}
        outside = [i for i in layers if not self.first <= i < self.last]
        if outside:
            raise ValueError(f"request {rid}: layers {outside} are not on shard [{self.first}, {self.last})")
        kv = self.kv.setdefault(rid, RequestKV())
        for i, (k, v) in layers.items():
            kv.layers[i] = (k.to(self.device, self.dtype), v.to(self.device, self.dtype))

    def free(self, rid: str) -> None:
        self.kv.pop(rid, None)
