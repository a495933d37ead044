"""Sampling in the Coral engine, against references computed here: the sampler's draws against the filtered
softmax (temperature, min_p, top_k, top_p) on fixed logits, greedy cases, seeds independent of the batch, logprobs
against log_softmax, penalties against transformers' `RepetitionPenaltyLogitsProcessor` and OpenAI's presence and
frequency penalties written out; through the HTTP server of an in-process instance: seeds, n, stop strings and
stop tokens, logprobs against the whole model's logits, refused parameters, and the context bound; a checkpoint
whose generation config sets `repetition_penalty` decodes as transformers' `generate` does (one instance, PD,
preemption)."""

from __future__ import annotations

import json
import math
import random
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from coral.engine.instance import CoralInstance, EngineConfig
from coral.engine.layout import Layout
from coral.engine.reference import WholeModel
from coral.engine.sampling import (
    Histories,
    SamplingParams,
    TokenHistory,
    filtered_logits,
    history_wire,
    sample,
    token_seed,
)
from coral.engine.scheduler import Request
from coral.tiny_model import TinyLlamaSpec, make_tiny_llama

pytestmark = pytest.mark.timeout(300)

LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.7, 0.3, 0.0, -0.5, -1.0, -2.0])
DRAWS = 6000


def reference_probs(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """vLLM's filtering written out on plain floats: temperature, then min_p, top_k, top_p, each renormalised."""
    z = [x / temperature for x in logits]
    m = max(z)
    p = [math.exp(x - m) for x in z]
    p = [x / sum(p) for x in p]
    if min_p > 0:
        p = [x if x >= min_p * max(p) else 0.0 for x in p]
    if top_k > 0:
        kth = sorted(p, reverse=True)[top_k - 1]
        p = [x if x >= kth else 0.0 for x in p]
    p = [x / sum(p) for x in p]
    if top_p < 1:
        keep, mass = set(), 0.0
        for i in sorted(range(len(p)), key=lambda i: -p[i]):
            if mass >= top_p:
                break
            keep.add(i)
            mass += p[i]
        p = [x if i in keep else 0.0 for i, x in enumerate(p)]
    return [x / sum(p) for x in p]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(1.0, 0, 1.0, 0.0), (0.6, 0, 1.0, 0.0), (1.3, 4, 1.0, 0.0), (1.0, 0, 0.7, 0.0), (1.0, 0, 1.0, 0.2),
     (0.8, 6, 0.9, 0.05)],
)
def test_draws_follow_the_filtered_softmax(temperature, top_k, top_p, min_p):
    """6000 draws of one step in one micro-batch, seeded 0..5999 and unseeded (the node's generator, seeded
    here): each token's frequency within 4.5 binomial standard deviations of the reference probability,
    filtered tokens never drawn."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    assert not params.greedy
    probs = reference_probs(LOGITS.tolist(), temperature, top_k, top_p, min_p)
    torch.manual_seed(0)
    for steps in ([replace(params, seed=s).step(0, frozenset()) for s in range(DRAWS)],
                  [params.step(0, frozenset())] * DRAWS):
        tokens = [s.token for s in sample(LOGITS.expand(DRAWS, -1), steps)]
        for tok, p in enumerate(probs):
            freq = tokens.count(tok) / DRAWS
            if p == 0:
                assert freq == 0, tok
            else:
                assert abs(freq - p) <= 4.5 * math.sqrt(p * (1 - p) / DRAWS) + 1e-9, (tok, freq, p)


def test_greedy_cases_and_banned_tokens():
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    greedy = logits.argmax(-1).tolist()
    for params in (SamplingParams(), SamplingParams(temperature=0.9, top_k=1, seed=3)):
        assert params.greedy
        assert [s.token for s in sample(logits, [params.step(0, frozenset())] * 8)] == greedy
    banned = frozenset(greedy[:1])  # min_tokens: the stop tokens are masked before the 2nd token
    ban = SamplingParams(min_tokens=2)
    first = sample(logits[:1], [ban.step(1, banned)])[0].token
    assert first != greedy[0] and first == int(logits[0].topk(2).indices[1])
    assert sample(logits[:1], [ban.step(2, banned)])[0].token == greedy[0]  # allowed once min_tokens are out


def test_a_seeded_draw_ignores_the_batch_around_it():
    """Same (seed, output index): same token alone, in a batch, at another row, beside greedy rows."""
    torch.manual_seed(1)
    logits = torch.randn(6, 300)
    p = SamplingParams(temperature=1.0, seed=42)
    alone = sample(logits[2:3], [p.step(5, frozenset())])[0].token
    others = [SamplingParams(temperature=0.7, seed=s).step(0, frozenset()) for s in range(5)]
    batch = sample(logits[[0, 1, 2, 3, 4, 5]], [others[0], others[1], p.step(5, frozenset()), *others[2:]])
    assert batch[2].token == alone
    mixed = sample(logits[[2, 0]], [p.step(5, frozenset()), SamplingParams().step(0, frozenset())])
    assert mixed[0].token == alone
    draws = {sample(logits[2:3], [SamplingParams(temperature=1.0, seed=s).step(5, frozenset())])[0].token
             for s in range(40)}
    assert len(draws) > 5  # other seeds, other tokens
    assert token_seed(42, 5) != token_seed(42, 6) != token_seed(43, 5)


def test_logprobs_are_the_raw_log_softmax():
    torch.manual_seed(2)
    logits = torch.randn(3, 40)
    ref = logits.log_softmax(-1)
    out = sample(logits, [SamplingParams(temperature=0.5, seed=1, logprobs=3).step(0, frozenset()),
                          SamplingParams(logprobs=0).step(0, frozenset()), SamplingParams().step(0, frozenset())])
    for row, s in enumerate(out[:2]):
        assert s.logprob == pytest.approx(float(ref[row, s.token]), abs=1e-5)
    top = ref[0].topk(3)
    assert [t for t, _ in out[0].top] == top.indices.tolist()
    assert [lp for _, lp in out[0].top] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert out[1].top == () and out[2].logprob is None


# --- penalties ---------------------------------------------------------------------------------------------


def histories_of(prompts: list[list[int]], outputs: list[list[int]]) -> list[TokenHistory]:
    return [TokenHistory.of_wire(history_wire(p, o), torch.device("cpu")) for p, o in zip(prompts, outputs,
                                                                                           strict=True)]


def random_histories(rows: int, vocab: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and outputs of random token ids, with repeats (an output may be empty)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab // 2) for _ in range(rng.randint(1, 30))] for _ in range(rows)]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 20))] for _ in range(rows)]
    return prompts, outputs


def test_repetition_penalty_is_transformers():
    """Each row's logits after `repetition_penalty` p equal transformers' processor on the row's prompt + output
    (positive logits of seen ids divided by p, the others multiplied), p below 1 included; a row without a
    penalty in the same batch is untouched."""
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(3)
    vocab, penalties = 64, [1.3, 0.7, 2.0, 1.0, 1.05, 0.5]
    logits = torch.randn(len(penalties), vocab) * 3
    prompts, outputs = random_histories(len(penalties), vocab, 3)
    steps = [SamplingParams(repetition_penalty=p).step(len(o), frozenset()) for p, o in zip(penalties, outputs,
                                                                                          strict=True)]
    assert ["rp" in st for st in steps] == [p != 1 for p in penalties]
    got = filtered_logits(logits, steps, histories_of(prompts, outputs))
    for row, p in enumerate(penalties):
        ids = torch.tensor([prompts[row] + outputs[row]])
        want = RepetitionPenaltyLogitsProcessor(p)(ids, logits[row:row + 1].clone())[0]
        assert torch.allclose(got[row], want, atol=1e-6), row
    assert torch.equal(got[3], logits[3])


def test_presence_and_frequency_penalties_as_openai_writes_them():
    """logit - frequency x count in the output - presence x [in the output], on plain floats (the prompt does
    not count), after the repetition penalty when both are set (vLLM's order)."""
    torch.manual_seed(4)
    vocab = 40
    params = [SamplingParams(presence_penalty=0.5), SamplingParams(frequency_penalty=0.8),
              SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5),
              SamplingParams(repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.6), SamplingParams()]
    logits = torch.randn(len(params), vocab) * 2
    prompts, outputs = random_histories(len(params), vocab, 4)
    outputs[0] += outputs[0][:3]  # repeats in the output
    steps = [p.step(len(o), frozenset()) for p, o in zip(params, outputs, strict=True)]
    histories = [h if p.penalized else None for p, h in zip(params, histories_of(prompts, outputs), strict=True)]
    got = filtered_logits(logits, steps, histories)
    for row, p in enumerate(params):
        seen = set(prompts[row]) | set(outputs[row])
        for tok in range(vocab):
            x = float(logits[row, tok])
            if tok in seen and p.repetition_penalty != 1:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            count = outputs[row].count(tok)
            x -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            assert float(got[row, tok]) == pytest.approx(x, abs=1e-5), (row, tok)


def test_penalties_steer_greedy_and_the_history_grows_with_each_token():
    """A greedy row takes the argmax of its penalised logits; the node's history of a request is made from the
    step carrying it, grows by each sampled token, and is required (KeyError) for a penalised step."""
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    step = SamplingParams(repetition_penalty=1.2).step(0, frozenset())
    histories = Histories()
    rows = histories.rows(["r"], [{**step, "hist": history_wire([0, 0], [])}], torch.device("cpu"))
    first = sample(logits, [step], rows)
    assert first[0].token == 1  # 3.0 / 1.2 < 2.9
    histories.record(rows, first)
    assert histories.by_rid["r"].output == [1]
    rows = histories.rows(["r"], [step], torch.device("cpu"))
    assert sample(logits, [step], rows)[0].token == 0  # 3.0 / 1.2 = 2.5 > 2.9 / 1.2
    assert sample(logits, [SamplingParams().step(0, frozenset())])[0].token == 0
    histories.drop("r")
    with pytest.raises(KeyError, match="token history"):
        histories.rows(["r"], [step], torch.device("cpu"))


# --- through the HTTP server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def url(ckpt):
    layout = Layout.of([1, 3], [["a"], ["b", "c"]], instance_id="s", model="tiny")  # DP: paths differ per request
    inst = CoralInstance(layout, ckpt, EngineConfig(local=True, kv_cache_gib=0.05)).start()
    yield inst.url
    inst.stop()


PROMPT = [11, 52, 300, 7, 99]


def post(url: str, **body) -> httpx.Response:  # type: ignore[no-untyped-def]
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    return httpx.post(f"{url}{path}", json={"model": "tiny", **body}, timeout=120)


def token_ids(r: httpx.Response) -> list[list[int]]:
    assert r.status_code == 200, r.text
    return [c["token_ids"] for c in r.json()["choices"]]


def test_seeds_n_and_greedy_through_http(url, whole):
    common = {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
    assert token_ids(post(url, **common, temperature=0)) == [whole.greedy(PROMPT, 8)[0]]
    assert token_ids(post(url, **common, top_k=1)) == [whole.greedy(PROMPT, 8)[0]]
    runs = {s: token_ids(post(url, **common, seed=s, temperature=1.5)) for s in (1, 2, 3)}
    assert token_ids(post(url, **common, seed=1, temperature=1.5)) == runs[1]  # same seed, same tokens
    assert len({json.dumps(r) for r in runs.values()}) > 1  # other seeds, other tokens
    r = post(url, **common, seed=1, temperature=1.5, n=3)
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
    assert token_ids(r) == [runs[1][0], runs[2][0], runs[3][0]]  # choice i is seeded seed + i (as vLLM)
    assert r.json()["usage"]["completion_tokens"] == 24


def test_stop_strings_and_stop_tokens(url, whole):
    ref, _ = whole.greedy(PROMPT, 12)
    base = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
    full = post(url, **base).json()["choices"][0]["text"]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = full[: full.find(stop)]
    r = post(url, **base, stop=["never-there", stop]).json()["choices"][0]
    assert r["text"] == cut and r["finish_reason"] == "stop"
    with httpx.stream("POST", f"{url}/v1/completions", json={"model": "tiny", **base, "stop": stop, "stream": True},
                      timeout=120) as s:
        chunks = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == cut and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    r = post(url, **base, stop_token_ids=[ref[4]]).json()["choices"][0]
    assert r["token_ids"] == ref[: ref.index(ref[4]) + 1] and r["finish_reason"] == "stop"


def test_logprobs_match_the_whole_model(url, whole, ckpt):
    ref, logits = whole.greedy(PROMPT, 4)
    lsm = logits.log_softmax(-1)
    r = post(url, prompt=PROMPT, max_tokens=4, ignore_eos=True, temperature=0, logprobs=3)
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == pytest.approx([float(lsm[i, t]) for i, t in enumerate(ref)], abs=1e-4)
    assert all(len(top) >= 3 for top in lp["top_logprobs"]) and len(lp["tokens"]) == 4
    text = r.json()["choices"][0]["text"]
    assert "".join(lp["tokens"]) == text and lp["text_offset"][0] == 0
    assert lp["text_offset"][1:] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(1, 4)]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    messages = [{"role": "user", "content": "hi there"}]
    chat_prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                             add_special_tokens=False)
    ref, logits = whole.greedy(chat_prompt, 3)
    r = post(url, messages=messages, max_tokens=3, ignore_eos=True, temperature=0, logprobs=True, top_logprobs=2)
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == pytest.approx(
        [float(logits.log_softmax(-1)[i, t]) for i, t in enumerate(ref)], abs=1e-4)
    assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["logprob"] >= c["logprob"] - 1e-6
               for c in content)
    assert len(content) == 3 and all(c["bytes"] == list(c["token"].encode()) for c in content)


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
     ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {"5": 3}}, "logit_bias"),
     ({"best_of": 3}, "best_of"), ({"response_format": {"type": "json_object"}}, "response_format"),
     ({"echo": True}, "echo"), ({"prompt": ["a", "b"]}, "prompt"), ({"temperature": 5}, "temperature"),
     ({"min_tokens": 9, "max_tokens": 3}, "min_tokens")],
)
def test_what_the_engine_does_not_do_is_refused(url, extra, param):
    r = post(url, **{"prompt": "hello", "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_the_context_bounds_prompt_and_max_tokens(url):
    """The tiny model's context is 2048 tokens (as vLLM: the prompt alone, or with max_tokens, over it is a 400;
    max_tokens unset gives the rest of the context)."""
    for n_prompt, max_tokens, param in [(2100, 200, "prompt"), (4000, None, "prompt"), (2000, 100, "max_tokens")]:
        body = {"prompt": [7] * n_prompt} | ({"max_tokens": max_tokens} if max_tokens else {})
        r = post(url, **body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == param
        assert "2048" in err["message"] and str(n_prompt) in err["message"]
    r = post(url, prompt=[7] * 2042, ignore_eos=True, temperature=0)
    assert r.json()["usage"]["completion_tokens"] == 6 and r.json()["choices"][0]["finish_reason"] == "length"


def test_streamed_choices_equal_the_whole_answer(url):
    """A seeded chat request with n=2, streamed (choices interleaved, each with its index; role in each choice's
    first chunk; a usage chunk last) and not: the same texts."""
    body = {"messages": [{"role": "user", "content": "tell me"}], "max_tokens": 10, "ignore_eos": True, "n": 2,
            "seed": 5, "temperature": 1.2, "top_p": 0.9}
    whole_answer = post(url, **body).json()
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120,
                      json={"model": "tiny", **body, "stream": True, "stream_options": {"include_usage": True}}) as s:
        chunks = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
    texts, seen = ["", ""], set()
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        assert ("role" in choice["delta"]) == (choice["index"] not in seen)
        seen.add(choice["index"])
        texts[choice["index"]] += choice["delta"]["content"]
    assert texts == [c["message"]["content"] for c in whole_answer["choices"]] and texts[0] != texts[1]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole_answer["usage"]


# --- a checkpoint whose generation config sets repetition_penalty ---------------------------------------------

RP = 1.3


@pytest.fixture(scope="module")
def rp_ckpt(tmp_path_factory):
    """The tiny model with `repetition_penalty: 1.3` in its generation_config.json (as some instruction-tuned
    checkpoints ship)."""
    path = make_tiny_llama(tmp_path_factory.mktemp("rp") / "tiny",
                           TinyLlamaSpec(num_hidden_layers=4, initializer_range=0.25))
    (path / "generation_config.json").write_text(json.dumps({"repetition_penalty": RP}))
    return path


def generate(ckpt: Path, prompt: list[int], n: int, **kw: Any) -> list[int]:
    """transformers' greedy `generate` (no stop at EOS), with the checkpoint's generation config and `kw`."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=2, **kw)
    return [int(t) for t in out[0, len(prompt):]]


def penalised_greedy(whole: WholeModel, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    """Greedy tokens with `params`' penalties written out: transformers' repetition processor on prompt + output,
    then frequency and presence over the output; each step recomputes the whole sequence."""
    from transformers import RepetitionPenaltyLogitsProcessor

    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            ids = torch.tensor([prompt + out])
            logits = whole.model(ids).logits[0, -1:].float()
            logits = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, logits)[0]
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[-1]).float()
            logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
            out.append(int(logits.argmax()))
    return out


def test_a_checkpoints_repetition_penalty_decodes_as_transformers_generate(rp_ckpt):
    """Unset, `repetition_penalty` is the generation config's (vLLM's `--generation-config auto`), and greedy
    tokens are transformers' `generate` with it, on a data-parallel instance and across PD (the prefill
    instance's first token penalised by the prompt, the decode instance's steps by prompt + output); set to 1 it
    is off. The penalty changes this model's greedy answer from its 17th token (a token of the prompt), so the
    test tells them apart."""
    n = 24
    penalised, plain = generate(rp_ckpt, PROMPT, n), generate(rp_ckpt, PROMPT, n, repetition_penalty=1.0)
    assert penalised == generate(rp_ckpt, PROMPT, n, repetition_penalty=RP) and penalised != plain
    layout = Layout.of([1, 3], [["a"], ["b", "c"]], instance_id="rp", model="tiny")
    inst = CoralInstance(layout, rp_ckpt, EngineConfig(local=True, kv_cache_gib=0.05)).start()
    pre = CoralInstance(Layout.of([4], [["p"]], instance_id="rp-pre", model="tiny"), rp_ckpt,
                        EngineConfig(local=True, kv_cache_gib=0.05)).start()
    try:
        body = {"prompt": PROMPT, "max_tokens": n, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
        assert token_ids(post(inst.url, **body)) == [penalised]
        assert token_ids(post(inst.url, **body, repetition_penalty=1.0)) == [plain]
        first = post(pre.url, **{**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        assert token_ids(first) == [penalised[:1]]
        decoded = post(inst.url, **body, kv_transfer_params=first.json()["kv_transfer_params"])
        assert token_ids(decoded) == [penalised]
        assert inst.scheduler is not None and inst.scheduler.remote_prefills == 1
    finally:
        pre.stop()
        inst.stop()


def test_penalties_hold_across_preemption(ckpt, whole):
    """Penalised greedy requests on a KV pool small enough to preempt them: each recomputed request's history
    is sent again with its KV, and every output equals the penalties written out."""
    rng = random.Random(11)
    # penalties that favour what was seen, so that every output here depends on its history being whole
    params = SamplingParams(repetition_penalty=0.5, presence_penalty=-2.0, frequency_penalty=-2.0)
    prompts = [[rng.randrange(7, 1024) for _ in range(rng.randint(3, 14))] for _ in range(8)]
    max_tokens = [rng.randint(4, 12) for _ in prompts]
    inst = CoralInstance(Layout.of([2, 2], [["a"], ["b"]]), ckpt,
                         EngineConfig(local=True, http=False, max_batch_tokens=6, kv_blocks=10,
                                      kv_block_size=4)).start()
    sched = inst.scheduler
    assert sched is not None
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def on_event(i: int):  # type: ignore[no-untyped-def]
        def handle(token, finish, _logits):  # type: ignore[no-untyped-def]
            if token is not None:
                outputs[i].append(token)
            if finish is not None:
                done[i].set()
        return handle

    try:
        for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True)):
            sched.submit(Request(rid=f"r{i}", prompt=p, max_tokens=n, on_event=on_event(i), sampling=params))
        assert all(ev.wait(120) for ev in done)
        assert sched.preemptions > 0
    finally:
        inst.stop()
    assert outputs == [penalised_greedy(whole, p, n, params) for p, n in zip(prompts, max_tokens, strict=True)]
    plain = [whole.greedy(p, n)[0] for p, n in zip(prompts, max_tokens, strict=True)]
    assert all(o != g for o, g in zip(outputs, plain, strict=True))  # the penalties matter
