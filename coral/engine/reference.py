"""The exactness reference: the same checkpoint run whole in one process by `transformers`, decoded greedily."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch


class WholeModel:
    def __init__(self, checkpoint: str | Path, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        try:
            model: Any = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa")
        except ValueError:  # no SDPA path in transformers for this architecture (gpt-oss: attention sinks)
            model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager")
        self.model: Any = model.to(self.device).eval()

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
        """`max_tokens` greedy tokens after `prompt` (no stop at EOS) and the logits of each step (steps, vocab):
        a prefill of the whole prompt, then one token per step on the model's KV cache."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        cache_kwarg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        x = torch.tensor([prompt], device=self.device)
        tokens: list[int] = []
        logits = []
        for _ in range(max_tokens):
            step = self.model(x, use_cache=True, **{cache_kwarg: cache}).logits[0, -1].float()
            logits.append(step)
            tokens.append(int(step.argmax()))
            x = torch.tensor([[tokens[-1]]], device=self.device)
        return tokens, torch.stack(logits)
