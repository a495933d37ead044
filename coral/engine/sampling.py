"""Sampling as vLLM does it: request parameters (`SamplingParams`, from a validated OpenAI request) and the
sampler the last stage's node runs on a micro-batch's logits (`sample`).

Per sampled step, in vLLM's order: tokens banned for the step (stop tokens before `min_tokens`) are masked,
then temperature (0: greedy, the argmax of the logits), min_p, top_k and top_p filter the distribution, and a
token is drawn from it by the exponential race (argmax of probs / q, q ~ Exp(1)). A seeded request's noise
comes from a generator seeded by (request seed, output index) alone: it gives the same tokens whatever
micro-batch, data-parallel path or recomputation after preemption its steps run in; unseeded rows draw their
noise together from the node's generator (one kernel). Logprobs are those of the
raw logits (vLLM's default `raw_logprobs`): the sampled token's and the top N.

Fields the engine does not implement are refused (`unsupported`) naming the field, as a 400 of OpenAI's shape.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from coral.openai_shapes import ChatCompletionRequest, CompletionRequest, InvalidRequest

MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence's tokens are chosen. `top_k` <= 0 and `top_p` 1 filter nothing; `logprobs`: None for
    none, else the number of top alternatives returned with each token's logprob."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def step(self, index: int, banned: frozenset[int]) -> dict[str, Any]:
        """The wire form of output token `index`'s sampling (what the last stage's node needs); `banned`: the
        request's stop tokens, masked while fewer than `min_tokens` tokens are out."""
        out: dict[str, Any] = {"t": 0.0 if self.greedy else self.temperature}
        if not self.greedy:
            out.update(p=self.top_p, k=self.top_k, m=self.min_p)
            if self.seed is not None:
                out["s"] = token_seed(self.seed, index)
        if index < self.min_tokens and banned:
            out["ban"] = sorted(banned)
        if self.logprobs is not None:
            out["lp"] = self.logprobs
        return out

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` of `n` (vLLM's: a given seed + the choice index)."""
        return self if self.seed is None else replace(self, seed=self.seed + index)


def token_seed(seed: int, index: int) -> int:
    """The generator seed of output token `index` of a request seeded `seed` (splitmix64 of both)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


GREEDY = SamplingParams()

# fields of the request schema the engine does not implement, refused when set to anything but their neutral value
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "echo": (None, False),
}
_UNSUPPORTED_EXTRA = ("response_format", "tools", "tool_choice", "functions", "function_call", "guided_json",
                      "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "prompt_logprobs",
                      "allowed_token_ids", "bad_words", "logits_processors", "include_stop_str_in_output")


def unsupported(body: dict[str, Any], req: CompletionRequest | ChatCompletionRequest) -> None:
    """InvalidRequest naming the first field set that this engine does not implement."""
    for name, neutral in _NEUTRAL.items():
        if getattr(req, name, None) not in neutral:
            raise InvalidRequest(f"'{name}' is not supported by the Coral engine", name)
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise InvalidRequest("'best_of' other than 'n' is not supported by the Coral engine", "best_of")
    for name in _UNSUPPORTED_EXTRA:
        if body.get(name) not in (None, False, [], {}):
            raise InvalidRequest(f"'{name}' is not supported by the Coral engine", name)
    if isinstance(req, CompletionRequest) and isinstance(req.prompt, list) and isinstance(req.prompt[0], list | str) \
            and len(req.prompt) > 1:
        raise InvalidRequest("one prompt per request: the Coral engine takes no batch of prompts", "prompt")


def sampling_params(req: CompletionRequest | ChatCompletionRequest, defaults: dict[str, Any]) -> SamplingParams:
    """The parameters of a validated request; unset fields take `defaults` (the checkpoint's generation config,
    as vLLM's `--generation-config auto`), then vLLM's (temperature 1)."""

    def pick(name: str, fallback: Any) -> Any:
        value = getattr(req, name, None)
        return value if value is not None else defaults.get(name, fallback)

    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs and not req.logprobs:
            raise InvalidRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    else:
        logprobs = req.logprobs
    return SamplingParams(
        temperature=float(pick("temperature", 1.0)), top_p=float(pick("top_p", 1.0)), top_k=int(pick("top_k", 0)),
        min_p=float(pick("min_p", 0.0)), seed=req.seed, min_tokens=req.min_tokens or 0, logprobs=logprobs,
    )


@dataclass(frozen=True)
class Sampled:
    """A step's token, and with logprobs asked: its logprob and the top alternatives (ids, logprobs)."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()

    def wire(self) -> list[Any]:
        return [self.token] if self.logprob is None else [self.token, self.logprob, [list(t) for t in self.top]]

    @classmethod
    def of_wire(cls, raw: list[Any]) -> Sampled:
        if len(raw) == 1:
            return cls(int(raw[0]))
        return cls(int(raw[0]), float(raw[1]), tuple((int(i), float(lp)) for i, lp in raw[2]))


def filtered_logits(logits: torch.Tensor, steps: list[dict[str, Any]]) -> torch.Tensor:
    """(rows, vocab) logits of sampled rows after banning, temperature, min_p, top_k and top_p (-inf: filtered)."""
    x = logits.to(torch.float32, copy=True)
    for row, st in enumerate(steps):
        if st.get("ban"):
            x[row, st["ban"]] = float("-inf")
    dev, inf = x.device, float("-inf")
    x /= torch.tensor([st["t"] or 1.0 for st in steps], device=dev)[:, None]
    if any(st.get("m", 0) > 0 for st in steps):
        min_p = torch.tensor([st.get("m", 0.0) for st in steps], device=dev)
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), inf)
    top_k = [k if 0 < (k := st.get("k", 0)) < x.shape[-1] else 0 for st in steps]  # 0: no top_k
    if any(top_k):
        index = torch.tensor([max(k, 1) - 1 for k in top_k], device=dev)[:, None]
        kth = x.topk(max(top_k), -1).values.gather(-1, index)
        off = torch.tensor([k == 0 for k in top_k], device=dev)
        x = x.masked_fill(x < kth.masked_fill(off[:, None], inf), inf)
    if any(st.get("p", 1.0) < 1 for st in steps):
        top_p = torch.tensor([st.get("p", 1.0) for st in steps], device=dev)
        order = x.argsort(-1, descending=True)
        probs = x.gather(-1, order).softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the tokens ranked above each one
        cut = (before >= top_p[:, None]) & (top_p[:, None] < 1)
        drop = torch.zeros_like(x, dtype=torch.bool).scatter(-1, order, cut)
        x = x.masked_fill(drop, inf)
    return x


def sample(logits: torch.Tensor, steps: list[dict[str, Any]]) -> list[Sampled]:
    """A token per row of `logits` (the micro-batch's sampled steps), each chosen by its `SamplingParams.step`
    wire form; greedy rows take the argmax of their (banned) logits."""
    x = filtered_logits(logits, steps) if any(st["t"] or "ban" in st for st in steps) else logits
    greedy = x.argmax(-1)
    drawn = [i for i, st in enumerate(steps) if st["t"]]
    tokens = greedy
    if drawn:
        rows = torch.tensor(drawn, device=x.device)
        probs = x[rows].softmax(-1)
        noise = torch.empty_like(probs).exponential_()
        for j, i in enumerate(drawn):
            if "s" in steps[i]:
                noise[j] = _exponential(x.shape[-1], steps[i]["s"], x.device)
        tokens = greedy.index_copy(0, rows, (probs / noise).argmax(-1))
    ids = tokens.tolist()
    want = [i for i, st in enumerate(steps) if "lp" in st]
    out = [Sampled(t) for t in ids]
    if want:
        rows = torch.tensor(want, device=x.device)
        lps = logits[rows].float().log_softmax(-1)
        n_top = max(steps[i]["lp"] for i in want)
        top_lp, top_ids = lps.topk(max(n_top, 1), -1)
        chosen = lps.gather(-1, tokens[rows][:, None])[:, 0].tolist()
        top_lp_l, top_ids_l = top_lp.tolist(), top_ids.tolist()
        for j, i in enumerate(want):
            n = steps[i]["lp"]
            out[i] = Sampled(ids[i], chosen[j], tuple(zip(top_ids_l[j][:n], top_lp_l[j][:n], strict=True)))
    return out


def _exponential(size: int, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return torch.empty(size, device=device).exponential_(generator=gen)
