"""Tiny models made locally (no download): config, tokenizer and seeded random weights, for each architecture
of the model catalog (`ARCHITECTURES`: llama, phi3, qwen3, qwen3_moe, gpt_oss) at the shape of its real
config scaled down (few layers, small hidden size and vocabulary, a few experts, a short sliding window).

Real engines (vLLM on CPU, the Coral pipeline engine) load it like any Hugging Face checkpoint, so runtime tests
exercise the real loading and serving code on a CPU in seconds. The tokenizer is a byte-level BPE trained with
`tokenizers` on a corpus generated from a fixed word list, so every string is encodable and the result is
deterministic.
"""

from __future__ import annotations

import fcntl
import json
import random
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
_WORDS = (  # the corpus vocabulary, split at use
    "the a of to and in is for on that with as by at from it this be are was an or which model layer token "
    "stage node pipeline prefill decode cache batch request latency throughput cost region price gpu memory "
    "serve route plan template instance cluster demand supply compute bandwidth budget queue answer question "
    "code write read print return value list loop function class data file time rate small large fast slow "
    "one two three four five six seven eight nine ten hello world please thanks yes no why how what where when"
)


CAUSAL_LM = {"llama": "LlamaForCausalLM", "phi3": "Phi3ForCausalLM", "qwen3": "Qwen3ForCausalLM",
             "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}  # model_type -> model class
ARCHITECTURES = tuple(CAUSAL_LM)
_WRITING = threading.Lock()  # weights come from torch's global generator: one writer at a time in a process


@dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny model; the defaults load in vLLM on CPU and run a forward pass in milliseconds. The MoE and
    sliding-window fields apply to the architectures that have them."""

    num_hidden_layers: int = 4
    hidden_size: int = 256
    intermediate_size: int = 512
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 1024
    max_position_embeddings: int = 2048
    seed: int = 0
    initializer_range: float = 0.02  # weight std; larger (e.g. 0.25) makes greedy outputs depend on the prompt
    num_experts: int = 4  # qwen3_moe, gpt_oss
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128  # each expert's width
    sliding_window: int = 8  # gpt_oss's sliding-attention layers (every other one, the first included)


TinyLlamaSpec = TinySpec  # the name its first users (Llama only) know


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    words = _WORDS.split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 24))) for _ in range(lines)]


def _train_tokenizer(spec: TinySpec, out: Path) -> int:
    """Train and save the tokenizer; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = spec.max_position_embeddings
    fast.save_pretrained(out)
    return int(tok.get_vocab_size())


def _config(arch: str, spec: TinySpec, special: dict[str, int]) -> Any:
    """The Hugging Face config of a tiny `arch` model: the real model's structure (phi-4, Qwen3-32B,
    Qwen3-235B-A22B, gpt-oss) at `spec`'s sizes."""
    from transformers import GptOssConfig, LlamaConfig, Phi3Config, Qwen3Config, Qwen3MoeConfig

    common: dict[str, Any] = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False, initializer_range=spec.initializer_range, dtype="float32", **special)
    moe: dict[str, Any] = {"num_experts_per_tok": spec.num_experts_per_tok}
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "phi3":  # phi-4 rotates all of a head; a partial rotary (Phi-4-mini's 0.75) exercises that path too
        return Phi3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 250000.0,
                                                     "partial_rotary_factor": 0.75})
    # Qwen3's heads are wider than hidden_size / heads (128 against 80 for Qwen3-32B, 64 for Qwen3-235B)
    wide: dict[str, Any] = {"head_dim": 2 * spec.hidden_size // spec.num_attention_heads}
    if arch == "qwen3":
        return Qwen3Config(**common, **wide)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, **moe, **wide, num_experts=spec.num_experts,
                              moe_intermediate_size=spec.moe_intermediate_size, norm_topk_prob=True)
    # gpt_oss: attention biases and sinks, alternating sliding/full layers, clamped SwiGLU (the config's defaults)
    common["intermediate_size"] = spec.moe_intermediate_size  # gpt-oss's intermediate_size is an expert's
    yarn = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "rope_theta": 150000.0, "original_max_position_embeddings": spec.max_position_embeddings // 32}
    return GptOssConfig(**common, **moe, head_dim=spec.hidden_size // spec.num_attention_heads,
                        num_local_experts=spec.num_experts, sliding_window=spec.sliding_window, rope_parameters=yarn)


def make_tiny(arch: str, out_dir: str | Path, spec: TinySpec | None = None, weights: bool = True) -> Path:
    """Write a Hugging Face checkpoint directory of architecture `arch` (one of `ARCHITECTURES`): config.json,
    tokenizer, and seeded float32 weights unless `weights` is False (for engines started with `--load-format
    dummy`). Idempotent for the same architecture and spec: returns `out_dir`."""
    spec = spec or TinySpec()
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch!r}: the tiny models are {', '.join(ARCHITECTURES)}")
    out = Path(out_dir)
    wanted = {**asdict(spec), "weights": weights, "architecture": arch}
    out.parent.mkdir(parents=True, exist_ok=True)
    # Callers race (a controller starting instances while a test loads the reference): threads and processes
    # wait for the one writer, then find its stamp, written last.
    with _WRITING, open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _stamped(out, wanted):
            _write(arch, out, spec, weights)
            (out / STAMP).write_text(json.dumps(wanted))
    return out


STAMP = "coral_tiny_spec.json"


def _stamped(out: Path, wanted: dict[str, Any]) -> bool:
    stamp = out / STAMP
    return stamp.exists() and json.loads(stamp.read_text()) == wanted


def _write(arch: str, out: Path, spec: TinySpec, weights: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / STAMP).unlink(missing_ok=True)
    vocab = _train_tokenizer(spec, out)
    if vocab > spec.vocab_size:
        raise ValueError(f"vocab_size: the tokenizer has {vocab} entries, more than the model's {spec.vocab_size}")

    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(out)
    config = _config(arch, spec, {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                                  "pad_token_id": tok.pad_token_id})
    config.architectures = [CAUSAL_LM[arch]]
    if weights:
        with torch.random.fork_rng(devices=[]):  # the caller's generator is left as it was
            torch.manual_seed(spec.seed)
            AutoModelForCausalLM.from_config(config).save_pretrained(out, safe_serialization=True)
    else:
        config.save_pretrained(out)


def make_tiny_llama(out_dir: str | Path, spec: TinySpec | None = None, weights: bool = True) -> Path:
    """`make_tiny("llama", ...)`."""
    return make_tiny("llama", out_dir, spec, weights)
