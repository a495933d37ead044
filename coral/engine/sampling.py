"""Sampling as vLLM does it: request parameters (`SamplingParams`, from a validated OpenAI request) and the
sampler the last stage's node runs on a micro-batch's logits (`sample`).

Per sampled step, in vLLM's order: tokens banned for the step (stop tokens before `min_tokens`) are masked,
then the penalties apply (`apply_penalties`), then temperature (0: greedy, the argmax of the penalised logits),
min_p, top_k and top_p filter the distribution, and a token is drawn from it by the exponential race (argmax of
probs / q, q ~ Exp(1)).

Penalties as vLLM applies them: `repetition_penalty` p (transformers' and vLLM's: a logit of a token id seen in
the prompt or the output so far is divided by p when positive, multiplied by p otherwise), then OpenAI's
`frequency_penalty` (minus f x the token's count in the output) and `presence_penalty` (minus p once the token is
in the output). A request that does not set `repetition_penalty` takes the checkpoint's generation config (as
vLLM does; e.g. 1.05 or 1.1 on some instruction-tuned models, a silent difference otherwise). What a
penalty looks at lives on the last stage's node (`TokenHistory`, by request): the scheduler sends the prompt's
token ids and the output so far with a penalised request's first sampled step there (again after its KV was
dropped: preempted, or a PD pull that failed), and the node adds each token it samples. A seeded request's noise
comes from a generator seeded by (request seed, output index) alone: it gives the same tokens whatever
micro-batch, data-parallel path or recomputation after preemption its steps run in; unseeded rows draw their
noise together from the node's generator (one kernel). Logprobs are those of the
raw logits (vLLM's default `raw_logprobs`): the sampled token's and the top N.

Fields the engine does not implement are refused (`unsupported`) naming the field, as a 400 of OpenAI's shape.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether a penalty applies (its steps need the request's `TokenHistory` on the last stage's node)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

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
        if self.repetition_penalty != 1:
            out["rp"] = self.repetition_penalty
        if self.presence_penalty:
            out["pp"] = self.presence_penalty
        if self.frequency_penalty:
            out["fp"] = self.frequency_penalty
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
    as vLLM's `--generation-config auto`: temperature, top_p, top_k, min_p, repetition_penalty), then vLLM's
    (temperature 1, no penalty)."""

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
        repetition_penalty=float(pick("repetition_penalty", 1.0)),
        presence_penalty=float(req.presence_penalty or 0.0), frequency_penalty=float(req.frequency_penalty or 0.0),
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


def history_wire(prompt: Sequence[int], output: Sequence[int]) -> dict[str, list[int]]:
    """What a penalised request's first sampled step on a node carries (`SamplingParams.step` under "hist"):
    its prompt's token ids (each once) and its output so far."""
    return {"p": sorted(set(prompt)), "o": list(output)}


@dataclass
class TokenHistory:
    """The token ids one request's penalties look at: those of its prompt (each once, on the logits' device)
    and its output so far."""

    prompt: torch.Tensor
    output: list[int]

    @classmethod
    def of_wire(cls, wire: dict[str, list[int]], device: torch.device) -> TokenHistory:
        return cls(torch.tensor(wire["p"], dtype=torch.long, device=device), list(wire["o"]))


class Histories:
    """The `TokenHistory` of each penalised request whose steps a last-stage node samples, by request id: made
    from the "hist" its first sampled step carries, extended by each token sampled, dropped with its KV."""

    def __init__(self) -> None:
        self.by_rid: dict[str, TokenHistory] = {}

    def rows(self, rids: Sequence[str], steps: Sequence[dict[str, Any]], device: torch.device
             ) -> list[TokenHistory | None]:
        """The history of each sampled row (None: no penalty); KeyError for a penalised row whose request has
        none here (the scheduler sends it with the request's first sampled step, so that is a bug)."""
        out: list[TokenHistory | None] = []
        for rid, st in zip(rids, steps, strict=True):
            if "hist" in st:
                self.by_rid[rid] = TokenHistory.of_wire(st["hist"], device)
            if not penalized(st):
                out.append(None)
            elif (h := self.by_rid.get(rid)) is not None:
                out.append(h)
            else:
                raise KeyError(f"request {rid}: a penalised step without the request's token history")
        return out

    def record(self, rows: Sequence[TokenHistory | None], sampled: Sequence[Sampled]) -> None:
        """Each penalised row's sampled token joins its output."""
        for h, s in zip(rows, sampled, strict=True):
            if h is not None:
                h.output.append(s.token)

    def drop(self, rid: str) -> None:
        self.by_rid.pop(rid, None)


def penalized(step: dict[str, Any]) -> bool:
    """Whether a step's wire form asks for a penalty."""
    return "rp" in step or "pp" in step or "fp" in step


def apply_penalties(x: torch.Tensor, steps: Sequence[dict[str, Any]],
                    histories: Sequence[TokenHistory | None]) -> torch.Tensor:
    """`x` (rows, vocab, float32) with each penalised row's penalties applied in place, vectorised over the rows
    (vLLM's `apply_penalties`): repetition (`rp`) on every token id of the prompt or the output, divided when
    positive, multiplied otherwise; then frequency (`fp` x its count in the output) and presence (`pp` once in
    the output) subtracted."""
    rows = [i for i, st in enumerate(steps) if penalized(st)]
    if not rows:
        return x
    dev, n = x.device, len(rows)
    hist = [histories[i] for i in rows]
    if any(h is None for h in hist):
        raise ValueError("a penalised row without its token history")
    counts = torch.zeros(n, x.shape[-1], dtype=torch.float32, device=dev)
    out_ids = [torch.tensor(h.output, dtype=torch.long, device=dev) for h in hist if h is not None]
    out_rows = torch.repeat_interleave(torch.arange(n, device=dev),
                                       torch.tensor([len(t) for t in out_ids], device=dev))
    counts.index_put_((out_rows, torch.cat(out_ids)), torch.ones(len(out_rows), device=dev), accumulate=True)
    in_output = counts > 0
    prompt_ids = [h.prompt for h in hist if h is not None]
    prompt_rows = torch.repeat_interleave(torch.arange(n, device=dev),
                                          torch.tensor([len(t) for t in prompt_ids], device=dev))
    seen = in_output.clone()
    seen[prompt_rows, torch.cat(prompt_ids)] = True
    index = torch.tensor(rows, device=dev)
    sub = x.index_select(0, index)
    rp = torch.tensor([steps[i].get("rp", 1.0) for i in rows], dtype=torch.float32, device=dev)[:, None]
    penalty = torch.where(seen, rp, torch.ones_like(rp))
    sub = torch.where(sub > 0, sub / penalty, sub * penalty)
    fp = torch.tensor([steps[i].get("fp", 0.0) for i in rows], dtype=torch.float32, device=dev)[:, None]
    pp = torch.tensor([steps[i].get("pp", 0.0) for i in rows], dtype=torch.float32, device=dev)[:, None]
    sub -= fp * counts + pp * in_output
    x.index_copy_(0, index, sub)
    return x


def filtered_logits(logits: torch.Tensor, steps: list[dict[str, Any]],
                    histories: Sequence[TokenHistory | None] | None = None) -> torch.Tensor:
    """(rows, vocab) logits of sampled rows after banning, penalties, temperature, min_p, top_k and top_p (-inf:
    filtered); `histories`: each row's `TokenHistory` (None for rows without a penalty)."""
    x = logits.to(torch.float32, copy=True)
    for row, st in enumerate(steps):
        if st.get("ban"):
            x[row, st["ban"]] = float("-inf")
    x = apply_penalties(x, steps, histories if histories is not None else [None] * len(steps))
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


def sample(logits: torch.Tensor, steps: list[dict[str, Any]],
           histories: Sequence[TokenHistory | None] | None = None) -> list[Sampled]:
    """A token per row of `logits` (the micro-batch's sampled steps), each chosen by its `SamplingParams.step`
    wire form (a penalised row needs its `TokenHistory` in `histories`); greedy rows take the argmax of their
    (banned, penalised) logits. Logprobs are those of the raw logits."""
    shaped = any(st["t"] or "ban" in st or penalized(st) for st in steps)
    x = filtered_logits(logits, steps, histories) if shaped else logits
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
