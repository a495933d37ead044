"""Activation transport between the stages of an instance, and tensor (de)serialisation for ZeroMQ frames.

`DistTransport` is torch.distributed point-to-point: one process group per instance (world = its nodes, rank =
node rank), gloo on CPU or NCCL on GPUs, chosen by configuration. Sends are asynchronous (`isend`), receives
block; the tag is the micro-batch id, so a node can receive micro-batches from several upstream nodes in the
scheduler's dispatch order. `LocalTransport` does the same between threads of one process (queues), for tests
running many layouts without paying a process start per node.
"""

from __future__ import annotations

import json
import queue
import threading
from collections import defaultdict
from typing import Any, Protocol

import torch
import torch.distributed as dist

TAG_MOD = 2**31 - 1


class Transport(Protocol):
    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None: ...

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int) -> torch.Tensor: ...

    def close(self) -> None: ...


class DistTransport:
    """torch.distributed P2P; `init_method` is 'tcp://HOST:PORT' across machines or 'file://PATH' on one."""

    def __init__(self, backend: str, init_method: str, rank: int, world_size: int, device: str) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
        self.pending: list[tuple[Any, torch.Tensor]] = []

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        tensor = tensor.contiguous()
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]
        self.pending.append((dist.isend(tensor, dst, tag=tag % TAG_MOD), tensor))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(out, src, tag=tag % TAG_MOD)
        return out

    def close(self) -> None:
        for work, _ in self.pending:
            work.wait()
        dist.destroy_process_group()


class LocalHub:
    """Mailboxes shared by the `LocalTransport`s of one in-process instance."""

    def __init__(self) -> None:
        self.boxes: dict[tuple[int, int, int], queue.Queue[torch.Tensor]] = defaultdict(queue.Queue)
        self.lock = threading.Lock()

    def box(self, src: int, dst: int, tag: int) -> queue.Queue[torch.Tensor]:
        with self.lock:
            return self.boxes[(src, dst, tag)]

    def drop(self, src: int, dst: int, tag: int) -> None:
        with self.lock:
            self.boxes.pop((src, dst, tag), None)


class LocalTransport:
    def __init__(self, hub: LocalHub, rank: int, timeout_s: float = 120.0) -> None:
        self.hub, self.rank, self.timeout_s = hub, rank, timeout_s

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self.hub.box(self.rank, dst, tag).put(tensor.clone())

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int) -> torch.Tensor:
        out = self.hub.box(src, self.rank, tag).get(timeout=self.timeout_s)
        self.hub.drop(src, self.rank, tag)
        if tuple(out.shape) != shape or out.dtype != dtype:
            raise RuntimeError(f"rank {self.rank}: got {tuple(out.shape)} {out.dtype}, expected {shape} {dtype}")
        return out

    def close(self) -> None:
        pass


def tensor_frames(tensors: list[torch.Tensor]) -> list[bytes]:
    """A JSON header (shapes, dtypes) and one raw frame per tensor (copied to host memory)."""
    host = [t.detach().to("cpu").contiguous() for t in tensors]
    header = [{"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for t in host]
    return [json.dumps(header).encode(), *(t.view(torch.uint8).numpy().tobytes() for t in host)]


def frames_tensors(frames: list[bytes]) -> list[torch.Tensor]:
    header = json.loads(frames[0])
    out = []
    for meta, raw in zip(header, frames[1:], strict=True):
        flat = torch.frombuffer(bytearray(raw), dtype=getattr(torch, meta["dtype"]))
        out.append(flat.reshape(meta["shape"]))
    return out


def advertised(endpoint: str, host: str) -> str:
    """`endpoint` ('tcp://BIND:PORT') with the host others reach it by, if one is given."""
    if not host or not endpoint.startswith("tcp://"):
        return endpoint
    return f"tcp://{host}:{endpoint.rsplit(':', 1)[1]}"
