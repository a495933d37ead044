"""The gateway through the official `openai` client (sync, async, streaming) and OpenAI's shapes for models,
errors and validation; vLLM's PD conventions (one request id on both sides, prefill-only options stripped)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from test_runtime_gateway import FAST, chat, sse_events, stack

from coral.openai_shapes import InvalidRequest, parse_request
from coral.runtime.emulated import token_text

pytestmark = pytest.mark.timeout(120)

MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def pd():
    with stack() as s:
        s.engine("p0", "m", "prefill", 1.0, FAST)
        s.engine("d0", "m", "decode", 1.0, FAST)
        yield s


def client(s) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{s.gateway.url}/v1", api_key="unused", max_retries=0)


def test_sync_client_chat_completions_and_models(pd):
    c = client(pd)
    r = c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.content == "".join(token_text("hello there", i) for i in range(4))
    assert r.usage is not None and r.usage.completion_tokens == 4
    c2 = c.completions.create(model="m", prompt="a b", max_tokens=2)
    assert c2.id.startswith("cmpl-") and c2.choices[0].text == token_text("a b", 0) + token_text("a b", 1)
    models = c.models.list()
    assert [m.id for m in models.data] == ["m"] and models.data[0].created > 0
    assert c.models.retrieve("m").id == "m"
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("nope")
    assert e.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_streaming_with_usage_chunk(pd):
    c = client(pd)
    stream = c.chat.completions.create(
        model="m",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "".join(token_text("hello there", i) for i in range(3))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 3
    assert all(ch.usage is None for ch in chunks[:-1])
    assert len({ch.id for ch in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


def test_async_client_concurrent_and_streaming(pd):
    async def run() -> tuple[list[str], str]:
        c = openai.AsyncOpenAI(base_url=f"{pd.gateway.url}/v1", api_key="unused", max_retries=0)
        rs = await asyncio.gather(
            *(
                c.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": f"q {i}"}], max_tokens=2
                )
                for i in range(8)
            )
        )
        stream = await c.completions.create(model="m", prompt="x y", max_tokens=3, stream=True)
        text = "".join([ch.choices[0].text async for ch in stream])
        await c.close()
        return [r.choices[0].message.content or "" for r in rs], text

    contents, text = asyncio.run(run())
    assert contents == ["".join(token_text(f"q {i}", k) for k in range(2)) for i in range(8)]
    assert text == "".join(token_text("x y", i) for i in range(3))
    assert all(e.inflight == 0 for e in pd.registry.all())


def test_one_request_id_on_both_sides_and_min_tokens_stripped(pd):
    """The emulated engine, like vLLM, refuses min_tokens > max_tokens, so min_tokens must not reach the
    prefill request (max_tokens=1); the decode side keeps it."""
    r = httpx.post(
        f"{pd.gateway.url}/v1/chat/completions",
        json={**chat(n=4), "min_tokens": 3},
        headers={"X-Request-Id": "trace-42"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "trace-42" and r.json()["id"] == "chatcmpl-trace-42"
    assert pd.state("p0").request_ids[-1] == pd.state("d0").request_ids[-1] == "trace-42"
    r = httpx.post(f"{pd.gateway.url}/v1/chat/completions", json=chat(n=2), timeout=10)
    rid = r.headers["x-request-id"]
    assert len(rid) == 32 and pd.state("p0").request_ids[-1] == pd.state("d0").request_ids[-1] == rid


def test_validation_errors_name_the_field(pd):
    c = client(pd)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="m", messages=[], max_tokens=2)
    assert e.value.body == {  # type: ignore[comparison-overlap]
        "message": "'messages': List should have at least 1 item after validation, not 0",
        "type": "invalid_request_error",
        "param": "messages",
        "code": None,
    }
    url = f"{pd.gateway.url}/v1/chat/completions"
    cases = [
        ({"model": "m"}, "messages"),
        ({**chat(), "max_tokens": "7"}, "max_tokens"),
        ({**chat(), "max_tokens": 0}, "max_tokens"),
        ({**chat(), "temperature": 3}, "temperature"),
        ({**chat(), "stream": "yes"}, "stream"),
        ({**chat(), "stream_options": {"include_usage": True}}, "stream_options"),
        ({**chat(), "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({**chat(), "messages": ["hi"]}, "messages[0]"),
        ({"messages": MESSAGES}, "model"),
        ({**chat(), "kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params"),
    ]
    for body, param in cases:
        r = httpx.post(url, json=body, timeout=10)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", err
    r = httpx.post(f"{pd.gateway.url}/v1/completions", json={"model": "m", "prompt": [1.5]}, timeout=10)
    assert r.json()["error"]["param"] == "prompt"
    assert all(e.inflight == 0 for e in pd.registry.all()) and pd.gw.active == 0


def test_error_shapes_for_unknown_routes_models_and_embeddings(pd):
    c = client(pd)
    with pytest.raises(openai.NotFoundError) as e:
        c.embeddings.create(model="m", input="x")
    assert set(e.value.body) == {"message", "type", "param", "code"}  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=1)  # type: ignore[arg-type]
    for method, path in [("GET", "/v1/nothing"), ("POST", "/v1/responses"), ("GET", "/v1/chat/completions")]:
        r = httpx.request(method, f"{pd.gateway.url}{path}", timeout=10)
        assert r.status_code in (404, 405)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
        assert err["code"] is None or isinstance(err["code"], str)
    bad = httpx.post(f"{pd.gateway.url}/v1/chat/completions", content=b"\xff{", timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_streamed_sse_events_parse_as_openai_chunks(pd):
    body = {**chat(n=2, stream=True), "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{pd.gateway.url}/v1/chat/completions", json=body, timeout=10) as r:
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]" and events[-2]["usage"]["total_tokens"] > 0  # type: ignore[index]


@pytest.mark.parametrize(
    ("body", "chat_api", "param"),
    [
        ({"model": "m", "prompt": "x", "n": True}, False, "n"),
        ({"model": "m", "prompt": [[1, 2], [3]]}, False, None),
        ({"model": "m", "messages": [{"role": "user", "content": None}]}, True, None),
        ({"model": "", "prompt": "x"}, False, "model"),
        ([], True, None),
    ],
)
def test_validate_request_cases(body, chat_api, param):
    if param is None and isinstance(body, dict):
        parse_request(body, chat_api)
        return
    with pytest.raises(InvalidRequest) as e:
        parse_request(body, chat_api)
    assert e.value.param == param


COMPLETION, CHAT = {"model": "m", "prompt": "x"}, {"model": "m", "messages": MESSAGES}


@pytest.mark.parametrize(
    ("body", "chat_api", "param"),
    [
        ({**COMPLETION, "top_k": "x"}, False, "top_k"),
        ({**COMPLETION, "stop": 5}, False, "stop"),
        ({**COMPLETION, "seed": "x"}, False, "seed"),
        ({**COMPLETION, "logprobs": 100}, False, "logprobs"),
        ({**COMPLETION, "prompt": [[1, True]]}, False, "prompt"),
        ({**COMPLETION, "prompt": [[1, -2]]}, False, "prompt"),
        ({**COMPLETION, "n": 1 << 31}, False, "n"),
        ({**COMPLETION, "max_tokens": 1 << 31}, False, "max_tokens"),
        ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, True, "messages[0].content"),
        ({**CHAT, "messages": [{"role": "user", "content": [{"type": "video", "x": 1}]}]}, True,
         "messages[0].content"),
        ({**CHAT, "messages": [{"role": "user", "content": [5]}]}, True, "messages[0].content"),
        ({**CHAT, "top_logprobs": 21}, True, "top_logprobs"),
        ({**CHAT, "logprobs": 3}, True, "logprobs"),
        ({**CHAT, "logit_bias": {"5": 1000}}, True, "logit_bias.5"),
        ({**CHAT, "user": 7}, True, "user"),
    ],
)
def test_openai_schema_refuses_what_it_does_not_define(pd, body, chat_api, param):
    """Cases a hand-written check let through as 200: each is a 400 naming the field, through the gateway."""
    path = "/v1/chat/completions" if chat_api else "/v1/completions"
    r = httpx.post(f"{pd.gateway.url}{path}", json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_openai_schema_keeps_what_vllm_accepts():
    parse_request({**COMPLETION, "prompt": [[1, 2]], "top_k": -1, "seed": 7, "stop": ["a", "b"], "logprobs": 5,
                   "ignore_eos": True, "return_token_ids": True, "min_tokens": 2, "guided_json": {}}, False)
    content = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    parse_request({**CHAT, "messages": [{"role": "user", "content": content}], "logprobs": True,
                   "top_logprobs": 3, "stream": True, "stream_options": {"include_usage": True},
                   "tools": [{"type": "function", "function": {"name": "f"}}]}, True)
