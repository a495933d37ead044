"""Every architecture of the model catalog on the Coral engine (llama, phi3, qwen3, qwen3_moe, gpt_oss), each on a
tiny checkpoint of its real structure (`coral.tiny_model.make_tiny`): greedy outputs are token-identical
to transformers' own `generate(do_sample=False)` on one whole-model node, an uneven pipeline, two data-parallel
nodes in a stage (thread nodes, chunked prefills), tensor parallelism 2 (two gloo processes running the shards;
marked slow: the MoE architectures through an instance's node processes), and PD (a prefill instance hands its KV
to a decode instance of another layout). Plus: an unknown model_type is refused, MXFP4
experts (gpt-oss's real format) are dequantised at load, and `coral serve --backend coral` serves each catalog
model with the tiny model of its architecture."""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine import local, run_requests

from coral.engine.layout import Layout
from coral.engine.shard import Shard, Step
from coral.tiny_model import ARCHITECTURES, TinySpec, make_tiny

pytestmark = pytest.mark.timeout(300)

SPEC = TinySpec(initializer_range=0.25)  # 4 layers; gpt_oss: sliding window of 8 tokens on layers 0 and 2
_rng = random.Random(5)
PROMPTS = [[11, 52, 300, 7], [500], [_rng.randrange(7, 1024) for _ in range(13)]]  # the last crosses the window
MAX_TOKENS = [6, 4, 7]


def tiny(arch: str, root: Path) -> Path:
    return make_tiny(arch, root / "engine-models" / arch, SPEC)


def generate(ckpt: Path, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """transformers' greedy `generate`, with no stop at EOS (as the engine's requests here)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    model.generation_config.eos_token_id = None
    return [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=2)[0, len(p):].tolist()
            for p, n in zip(prompts, max_tokens, strict=True)]


def shard_greedy(stages: list[Shard], prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Greedy decoding straight through the shards of a pipeline: all prompts in one micro-batch, then their
    decode steps together."""
    outs: list[list[int]] = [[] for _ in prompts]
    steps = [Step(str(i), 0, len(p)) for i, p in enumerate(prompts)]
    x = [t for p in prompts for t in p]
    while steps:
        h = torch.tensor(x)
        for stage in stages:
            h = stage.forward_batch(steps, h)
        going, x = [], []
        for s, token in zip(steps, h.argmax(-1).tolist(), strict=True):
            outs[int(s.rid)].append(token)
            if len(outs[int(s.rid)]) < max_tokens[int(s.rid)]:
                going.append(Step(s.rid, s.start + s.n, 1))
                x.append(token)
        steps = going
    return outs


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """A tiny checkpoint of each architecture, and transformers' greedy outputs for PROMPTS."""
    ckpt = tiny(request.param, tmp_path_factory.getbasetemp())
    return ckpt, generate(ckpt, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("layout", [
    Layout.of([4], [["whole"]]),
    Layout.of([1, 3], [["a"], ["b"]]),  # uneven pipeline
    Layout.of([2, 2], [["a", "b"], ["c"]], [[1.0, 2.0], [1.0]]),  # two data-parallel nodes in the first stage
], ids=["whole", "pipeline-1-3", "dp-2"])
def test_layouts_match_generate(model: tuple[Path, list[list[int]]], layout: Layout) -> None:
    """Concurrent requests with prefills chunked to 5 tokens (the 13-token prompt crosses gpt-oss's window in
    chunks) on a small paged pool."""
    ckpt, expected = model
    inst = local(layout, ckpt, max_batch_tokens=5, kv_blocks=12, kv_block_size=4)
    try:
        results = run_requests(inst, PROMPTS, MAX_TOKENS)
    finally:
        inst.stop()
    assert [tokens for tokens, _, _ in results] == expected


def test_logits_are_as_close_to_exact_as_transformers_own(model: tuple[Path, list[list[int]]]) -> None:
    """Logits, not only tokens: a whole-model shard's logits at every step (prefill in chunks of 5, then 16 greedy
    decode steps, prompts crossing gpt-oss's window) against the same model run in float64. The engine's float32
    error is within twice transformers' own float32 error on the same tokens (on gpt-oss's tiny model both reach
    about 1e-3: its sinks and 0.25-std weights amplify float32 rounding; dense models stay near 1e-4)."""
    from transformers import AutoModelForCausalLM

    ckpt, _ = model
    exact: Any = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64, experts_implementation="eager").eval()
    single: Any = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    rng = random.Random(3)
    engine_err = transformers_err = 0.0
    for prompt in ([rng.randrange(7, 1024) for _ in range(13)], [rng.randrange(7, 1024) for _ in range(30)]):
        shard = Shard(ckpt, 0, 4, kv_blocks=64, block_size=4)
        seq = list(prompt)
        for start in range(0, len(prompt), 5):
            chunk = prompt[start:start + 5]
            logits = shard.forward_batch([Step("0", start, len(chunk))], torch.tensor(chunk))[0]
        for _ in range(16):
            with torch.no_grad():
                truth = exact(torch.tensor([seq])).logits[0, -1]
                engine_err = max(engine_err, float((logits.double() - truth).abs().max()))
                transformers_err = max(transformers_err, float((single(torch.tensor([seq])).logits[0, -1].double()
                                                                 - truth).abs().max()))
            seq.append(int(logits.argmax()))
            logits = shard.forward_batch([Step("0", len(seq) - 1, 1)], torch.tensor(seq[-1:]))[0]
    assert engine_err <= 2 * transformers_err + 1e-5, (
        f"engine off float64 by {engine_err:.2e}, transformers' float32 by {transformers_err:.2e}")


def test_pd_hands_kv_to_a_decode_instance(model: tuple[Path, list[list[int]]]) -> None:
    """Prefill on [1, 3] layers, decode on [2, 2] with two nodes in its second stage, over the HTTP PD protocol:
    the decode instance takes the KV (no local prefill) and continues exactly."""
    ckpt, expected = model
    pre = local(Layout.of([1, 3], [["p0"], ["p1"]], instance_id="pre", model="tiny"), ckpt, http=True)
    dec = local(Layout.of([2, 2], [["d0"], ["d1", "d2"]], instance_id="dec", model="tiny"), ckpt, http=True)
    try:
        for prompt, n, ref in zip(PROMPTS, MAX_TOKENS, expected, strict=True):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            pd = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
            first = httpx.post(f"{pre.url}/v1/completions", json=pd, timeout=30).json()
            out = httpx.post(f"{dec.url}/v1/completions",
                             json={**body, "kv_transfer_params": first["kv_transfer_params"]}, timeout=30).json()
            assert first["choices"][0]["token_ids"] == ref[:1] and out["choices"][0]["token_ids"] == ref
        assert dec.scheduler is not None and dec.scheduler.remote_prefills == len(PROMPTS)
    finally:
        pre.stop()
        dec.stop()


def _tp_worker(rank: int, store: str, ckpts: dict[str, str], results: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        out = {}
        for arch, ckpt in ckpts.items():
            stages = [Shard(ckpt, a, b, tp_group=dist.group.WORLD, kv_blocks=16, block_size=4) for a, b in [(0, 1), (1, 4)]]
            out[arch] = shard_greedy(stages, PROMPTS, MAX_TOKENS)
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_2_matches_generate(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """Two processes of a gloo group each keep half of every layer (heads, sinks, MLP and per-expert
    intermediate features) over a 2-stage pipeline: both give transformers' tokens, for every architecture."""
    ckpts = {arch: str(tiny(arch, tmp_path_factory.getbasetemp())) for arch in ARCHITECTURES}
    expected = {arch: generate(Path(c), PROMPTS, MAX_TOKENS) for arch, c in ckpts.items()}
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_tp_worker, args=(r, str(tmp_path / "store"), ckpts, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        outs = dict(results.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
    assert outs[0] == outs[1] == expected


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_moe_tensor_parallel_node_processes(arch: str, tmp_path: Path,
                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same through an instance's node processes (`coral.engine.node`, gloo): a TP-2 node (2xA10G) for the
    first stage, a TP-1 node for the second, served over HTTP."""
    from coral.engine.instance import CoralInstance
    from coral.runtime.handmade import make_instance

    ckpt = tiny(arch, tmp_path_factory.getbasetemp())
    plan = make_instance("m", "decode", [(40, ["2xA10G"]), (24, ["1xL4"])], 900.0)
    inst = CoralInstance.from_plan(plan, ckpt, log_dir=tmp_path / "logs").start()
    try:
        assert inst.tp == [2, 1]
        outs = [httpx.post(f"{inst.url}/v1/completions", timeout=60, json={
            "model": "m", "prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
        }).json()["choices"][0]["token_ids"] for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
    finally:
        inst.stop()
    assert outs == generate(ckpt, PROMPTS, MAX_TOKENS)


def test_unknown_model_type_is_refused(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    ckpt = tmp_path / "mistral"
    shutil.copytree(tiny("llama", tmp_path_factory.getbasetemp()), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "model_type": "mistral",
                                                  "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(ValueError, match="model_type 'mistral' is not supported by the Coral engine"):
        Shard(ckpt, 0, 4)


FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def test_mxfp4_experts_are_dequantised_at_load(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """gpt-oss's real checkpoints store the experts as MXFP4 (`*_blocks`: two e2m1 values a byte, low nibble
    first, in blocks of 32 along the input features; `*_scales`: a power-of-two exponent + 127 per block). A
    tiny gpt_oss with such experts runs on the engine exactly as transformers runs its dequantised twin."""
    src = tiny("gpt_oss", tmp_path_factory.getbasetemp())
    mx, twin = tmp_path / "mxfp4", tmp_path / "twin"
    shutil.copytree(src, mx)
    shutil.copytree(src, twin)
    tensors = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    quantised, dequantised = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = tensors[name].shape  # transformers' layout: (experts, in, out)
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), dtype=torch.uint8, generator=gen)
        scales = torch.randint(122, 126, (experts, outputs, inputs // 32), dtype=torch.uint8, generator=gen)
        values = torch.stack([FP4[(blocks & 15).long()], FP4[(blocks >> 4).long()]], -1).flatten(-2)
        weight = (values * 2.0 ** (scales.float() - 127).unsqueeze(-1)).flatten(-2)  # (experts, out, in)
        dequantised[name] = weight.transpose(1, 2).contiguous()
        del quantised[name]
        quantised[f"{name}_blocks"], quantised[f"{name}_scales"] = blocks, scales
    save_file(quantised, mx / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantised, twin / "model.safetensors", metadata={"format": "pt"})
    shard = Shard(mx, 0, 4, kv_blocks=16, block_size=4)
    assert torch.equal(shard.layers[1].mlp.experts.down_proj, dequantised["model.layers.1.mlp.experts.down_proj"])
    assert shard_greedy([shard], PROMPTS, MAX_TOKENS) == generate(twin, PROMPTS, MAX_TOKENS)


def test_serve_backend_uses_each_catalog_architecture(tmp_path: Path) -> None:
    """`coral serve --backend coral` serves a plan model with the tiny model of its catalog `model_type`."""
    from transformers import AutoConfig

    from coral.runtime.coral_backend import SERVE_MODEL_LAYERS, CoralEngineBackend, serve_architecture

    assert {m: serve_architecture(m) for m in ("phi-4", "qwen3-32b", "qwen3-235b", "gpt-oss-20b", "gpt-oss-120b",
                                               "llama-3-70b", "not-in-the-catalog")} == {
        "phi-4": "phi3", "qwen3-32b": "qwen3", "qwen3-235b": "qwen3_moe", "gpt-oss-20b": "gpt_oss",
        "gpt-oss-120b": "gpt_oss", "llama-3-70b": "llama", "not-in-the-catalog": "llama"}
    ckpt = CoralEngineBackend(cache_dir=tmp_path).model_dir("qwen3-235b")
    config = AutoConfig.from_pretrained(ckpt)
    assert ckpt == tmp_path / "tiny-qwen3_moe"
    assert config.model_type == "qwen3_moe" and config.num_hidden_layers == SERVE_MODEL_LAYERS
