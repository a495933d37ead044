"""A tiny Llama-architecture model made locally (no download): config, tokenizer and seeded random weights.

Real engines (vLLM on CPU, the Coral pipeline engine) load it like any Hugging Face checkpoint, so runtime tests
exercise the real loading and serving code on a CPU in seconds. The tokenizer is a byte-level BPE trained with
`tokenizers` on a corpus generated from a fixed word list, so every string is encodable and the result is
deterministic.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

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


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of the tiny model; the defaults load in vLLM on CPU and run a forward pass in milliseconds."""

    num_hidden_layers: int = 4
    hidden_size: int = 256
    intermediate_size: int = 512
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 1024
    max_position_embeddings: int = 2048
    seed: int = 0
    initializer_range: float = 0.02  # weight std; larger (e.g. 0.25) makes greedy outputs depend on the prompt


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    words = _WORDS.split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 24))) for _ in range(lines)]


def _train_tokenizer(spec: TinyLlamaSpec, out: Path) -> int:
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


def make_tiny_llama(out_dir: str | Path, spec: TinyLlamaSpec | None = None, weights: bool = True) -> Path:
    """Write a Hugging Face checkpoint directory (config.json, tokenizer, and seeded weights unless `weights` is
    False, for engines started with `--load-format dummy`). Idempotent for the same spec: returns `out_dir`."""
    spec = spec or TinyLlamaSpec()
    out = Path(out_dir)
    stamp = out / "coral_tiny_spec.json"
    wanted = {**asdict(spec), "weights": weights}
    if stamp.exists() and json.loads(stamp.read_text()) == wanted:
        return out
    out.mkdir(parents=True, exist_ok=True)
    vocab = _train_tokenizer(spec, out)
    if vocab > spec.vocab_size:
        raise ValueError(f"vocab_size: the tokenizer has {vocab} entries, more than the model's {spec.vocab_size}")

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(out)
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=spec.initializer_range,
        dtype="float32",
    )
    config.architectures = ["LlamaForCausalLM"]
    if weights:
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
        model.save_pretrained(out, safe_serialization=True)
    else:
        config.save_pretrained(out)
    stamp.write_text(json.dumps(wanted))
    return out
