"""Weight sync over NCCL: a trainer rank on one GPU → a vLLM engine's worker on another GPU.

This module owns both halves of the transport (the vLLM worker extension calls the receiving half):
- `open_group`: a two-party NCCL communicator built on vLLM's `StatelessProcessGroup` (a TCP
  rendezvous that leaves `torch.distributed`'s global group alone, so Megatron keeps its own) and
  `PyNcclCommunicator`. The trainer is rank 0; the engine's worker is rank 1 (tensor parallel 1).
- `NcclWeights`: what travels beside the bytes, as plain msgpack types: the group's name, the
  entries (vLLM parameter name, dtype, shape, offset in the sender's flat buffer), the version and
  how the receiver takes them: `into="params"` receives every entry straight into its parameter's
  storage (one NCCL group call, no extra memory, no copy); `into="buffer"` receives the whole flat
  buffer into scratch memory and then copies each entry into its parameter (two passes).
- `NcclSender`: packs nothing itself; it sends a flat buffer (from `layout.pack_flat`) on a
  side stream after the packing kernels, so the trainer's next step is not held up, and keeps the
  buffer alive until the receiver has it. NCCL cannot cancel a transfer: a receiver that never joins
  is detected by a bounded wait, and the communicator is then aborted (the next sync fails clearly).
"""

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from oneloop.backends.megatron_local.weight_sync.layout import (
    FlatEntry,
    entries_from_wire,
    entries_to_wire,
    view_of,
)
from oneloop.errors import BackendError

GROUP_TIMEOUT_S = 120.0  # rendezvous of both ranks
TRANSFER_TIMEOUT_S = 300.0  # one weight transfer, receiver joining included
POLL_S = 0.0005
INTO = ("params", "buffer")


def open_group(host: str, port: int, rank: int, world_size: int, device: torch.device):
    """Join the two-party weight group (blocks until every rank has joined, bounded).

    Leaves the calling process as it found it: importing vLLM switches cuDNN attention off for the
    whole process (`vllm/platforms/cuda.py`), which changed a Megatron trainer's SDPA kernel and so
    its bf16 losses (measured on the device: 12,418.78 vs 12,419.20 for the same weights); and
    vLLM's `current_stream()` (called by the communicator) moves the thread to a new CUDA stream.
    Both are put back."""
    cudnn_sdp = torch.backends.cuda.cudnn_sdp_enabled()
    previous = torch.cuda.current_stream(device)
    try:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(
            host=host,
            port=port,
            rank=rank,
            world_size=world_size,
            store_timeout=int(GROUP_TIMEOUT_S),
        )
        comm = PyNcclCommunicator(group, device=device)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn_sdp)
        torch.cuda.set_stream(previous)
    if comm.disabled:
        raise BackendError(f"NCCL weight group {host}:{port}: NCCL is unavailable on {device}")
    return comm


def wait_event(event: torch.cuda.Event, comm, timeout: float, what: str) -> None:
    """Poll `event` until it completes; past `timeout`, abort `comm` (NCCL cannot cancel a
    transfer, aborting frees the stream) and raise."""
    deadline = time.monotonic() + timeout
    while not event.query():
        if time.monotonic() > deadline:
            comm.destroy()
            raise BackendError(
                f"NCCL weight sync: {what} did not complete within {timeout:.0f} s (the other "
                "side never joined); the weight group is aborted, restart the sampler"
            )
        time.sleep(POLL_S)


@dataclass(frozen=True)
class NcclWeights:
    """One weight version sent over the NCCL group `group` (see the module docstring)."""

    group: str
    nbytes: int
    entries: tuple[FlatEntry, ...]
    version: int
    into: str = "params"

    def __post_init__(self) -> None:
        if self.into not in INTO:
            raise ValueError(f"NcclWeights.into must be one of {INTO}, got {self.into!r}")

    def to_wire(self) -> dict:
        return {
            "group": self.group,
            "nbytes": self.nbytes,
            "entries": entries_to_wire(self.entries),
            "version": self.version,
            "into": self.into,
        }

    @classmethod
    def from_wire(cls, wire: dict) -> "NcclWeights":
        return cls(
            group=str(wire["group"]),
            nbytes=int(wire["nbytes"]),
            entries=entries_from_wire(wire["entries"]),
            version=int(wire["version"]),
            into=str(wire["into"]),
        )


def broadcast_entries(comm, tensors: Sequence[torch.Tensor], stream) -> None:
    """One NCCL group call broadcasting every tensor from rank 0 (both sides call this, with the
    same shapes in the same order: the sender's buffer views, the receiver's parameters)."""
    comm.group_start()
    try:
        for tensor in tensors:
            comm.broadcast(tensor, src=0, stream=stream)
    finally:
        comm.group_end()


class NcclSender:
    """Rank 0 of one weight group: sends flat weight buffers to the engine's worker."""

    def __init__(self, name: str, host: str, port: int, device: torch.device) -> None:
        self.name = name
        self.device = device
        self.comm = open_group(host, port, rank=0, world_size=2, device=device)
        self.stream = torch.cuda.Stream(device=device)
        self._pending: tuple[torch.Tensor, torch.cuda.Event] | None = None

    def send(
        self, buffer: torch.Tensor, entries: Sequence[FlatEntry], version: int, into: str = "params"
    ) -> NcclWeights:
        """Queue `buffer` for the receiver (returns at once); the previous transfer must have
        completed (bounded wait). The caller hands the returned `NcclWeights` to the engine."""
        weights = NcclWeights(self.name, buffer.numel(), tuple(entries), version, into)
        self.wait_sent()
        packed = torch.cuda.Event()
        packed.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(packed)
            if into == "params":
                broadcast_entries(self.comm, [view_of(buffer, e) for e in entries], self.stream)
            else:
                self.comm.broadcast(buffer, src=0, stream=self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        self._pending = (buffer, done)
        return weights

    def wait_sent(self, timeout: float = TRANSFER_TIMEOUT_S) -> None:
        """Block until the last queued buffer has reached the receiver, then release it."""
        if self._pending is None:
            return
        _, done = self._pending
        wait_event(done, self.comm, timeout, f"the transfer to group {self.name!r}")
        self._pending = None

    def bandwidth_probe(self, nbytes: int, iters: int) -> float:
        """Broadcast `nbytes` `iters` times (the receiver runs the same); returns seconds."""
        buf = torch.full((nbytes,), 7, dtype=torch.uint8, device=self.device)
        self.comm.broadcast(buf, src=0, stream=self.stream)
        self.stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            self.comm.broadcast(buf, src=0, stream=self.stream)
        self.stream.synchronize()
        return time.perf_counter() - t0

    def close(self) -> None:
        self.comm.destroy()
