"""A decode instance keeps decoding its running requests while it takes a new request's KV from a prefill
instance that answers late (busy with a long prefill micro-batch) or never: the pull does not block the decode
node's command loop (`coral.engine.node.Pulls`). Before, a node waited for each pull's answer in command order,
and every stream of the instance went without a token meanwhile (the gateway cut them as stalled under
`benchmarks/engine_load.py`)."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from typing import Any

import httpx
import pytest
import zmq

from coral.engine.instance import CoralInstance, EngineConfig
from coral.engine.layout import Layout
from coral.engine.scheduler import Request

pytestmark = pytest.mark.timeout(300)

DELAY_S = 2.0
"""How long the slow prefill source holds a take before it answers (or, `answer=False`, forever)."""
MAX_GAP_S = 1.0
"""The most a running request may wait for its next token meanwhile (a tiny-model decode step takes
milliseconds; before, it waited DELAY_S)."""


class SlowSource:
    """A prefill node's KV address that holds every take `DELAY_S` and then relays it to the real prefill node
    (`answer`), or never answers; `asked` is set at the first take."""

    def __init__(self, target: str, answer: bool) -> None:
        self.target, self.answer = target, answer
        self.asked = threading.Event()
        self.asked_at = 0.0
        self.stop = threading.Event()
        addr: queue.Queue[str] = queue.Queue()
        self.thread = threading.Thread(target=self._run, args=(addr,), daemon=True)
        self.thread.start()
        self.addr = addr.get(timeout=10)

    def _run(self, addr: queue.Queue[str]) -> None:
        ctx = zmq.Context.instance()  # the local instances' context: the prefill node's inproc address
        front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.REQ)
        port = front.bind_to_random_port("tcp://127.0.0.1")
        back.connect(self.target)
        addr.put(f"tcp://127.0.0.1:{port}")
        try:
            while not self.stop.is_set():
                if not front.poll(50):
                    continue
                ident, empty, raw = front.recv_multipart()
                if not self.asked.is_set():
                    self.asked_at = time.monotonic()
                    self.asked.set()
                if not self.answer or self.stop.wait(DELAY_S):
                    continue
                back.send(raw)
                front.send_multipart([ident, empty, *back.recv_multipart()])
        finally:
            front.close(linger=0)
            back.close(linger=0)


def decode_with_a_slow_pull(ckpt: Any, answer: bool) -> tuple[list[float], list[int], list[int], CoralInstance]:
    """A request decoding on a 2-stage decode instance; then a PD request whose KV comes through a `SlowSource`.
    The token times of the running request, the PD request's tokens and its prompt; the decode instance
    (stopped)."""
    pre = CoralInstance(Layout.of([4], [["p"]], instance_id="pre", model="tiny"), ckpt,
                        EngineConfig(local=True, http=True)).start()
    dec = CoralInstance(Layout.of([2, 2], [["d0"], ["d1"]], instance_id="dec", model="tiny"), ckpt,
                        EngineConfig(local=True, http=False, kv_pull_timeout_s=30.0 if answer else DELAY_S)).start()
    sched = dec.scheduler
    assert sched is not None
    source = None
    try:
        times: list[float] = []
        running = Request(rid="running", prompt=[11, 52, 300, 7], max_tokens=1800,
                          on_event=lambda t, f, lg: times.append(time.monotonic()) if t is not None else None)
        sched.submit(running)
        while len(times) < 5:
            time.sleep(0.01)
        prompt = [21, 8, 500, 77, 300, 12, 9]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "ignore_eos": True, "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": True}}
        coral = httpx.post(f"{pre.url}/v1/completions", json=body, timeout=30).json()["kv_transfer_params"]["coral"]
        (src,) = coral["sources"]
        source = SlowSource(src["kv"], answer)
        done = threading.Event()
        tokens: list[int] = []

        def on_event(token: int | None, finish: str | None, _: Any) -> None:
            if token is not None:
                tokens.append(token)
            if finish is not None:
                done.set()

        sched.submit(Request(rid="pd", prompt=prompt, max_tokens=6, on_event=on_event,
                             remote={**coral, "sources": [{**src, "kv": source.addr}]}))
        assert source.asked.wait(30)
        assert done.wait(60), "the PD request did not finish"
        end = max(time.monotonic(), source.asked_at + DELAY_S)
        while times[-1] < end:  # the running request's tokens over the whole wait
            time.sleep(0.01)
        sched.cancel("running")
        window = [t for t in times if source.asked_at - 0.5 <= t]
        gaps = [b - a for a, b in itertools.pairwise(window)]
        return gaps, tokens, prompt, dec
    finally:
        if source is not None:
            source.stop.set()
        dec.stop()
        pre.stop()


@pytest.mark.parametrize("answer", [True, False], ids=["answered-late", "never-answered"])
def test_running_requests_keep_decoding_while_a_pull_waits(ckpt, whole, answer):
    """The running request gets its tokens at its usual pace the whole time the pull waits (before: no token
    for DELAY_S); the PD request then decodes from the KV taken (`answered-late`) or, its pull expired after
    `kv_pull_timeout_s`, from a local prefill (`never-answered`), exactly as the whole model."""
    gaps, tokens, prompt, dec = decode_with_a_slow_pull(ckpt, answer)
    assert gaps and max(gaps) < MAX_GAP_S, f"the running request waited {max(gaps):.2f} s for a token"
    assert tokens == whole.greedy(prompt, 6)[0]
    assert dec.scheduler is not None and dec.scheduler.remote_prefills == (1 if answer else 0)
