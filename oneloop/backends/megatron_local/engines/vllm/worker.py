"""vLLM worker extension: the engine-side half of our weight loads (runs inside vLLM's worker).

vLLM mixes this class into its GPU worker when the engine is built with
`worker_extension_cls="oneloop.backends.megatron_local.engines.vllm.worker.OneloopWorkerExtension"`;
`AsyncLLM.collective_rpc("<method>", args=...)` then calls these methods on every worker. RPC
arguments and results are plain msgpack types (lists, dicts, str, int, bytes): vLLM's utility
channel decodes untyped, so tensors never travel as tensors here.

Three load paths:
- `load_hf_weights`: Hugging Face-named arrays (raw bytes) → the model's own `load_weights`, vLLM's
  per-layer loader (fuses q/k/v and gate/up itself). The reference path.
- `load_ipc_weights`: a `CudaIpcWeights` buffer (`weight_sync.ipc.load_ipc`); layout "vllm" copies
  each entry straight into its parameter's storage (`param.data.copy_`), after checking that
  names, shapes and dtypes match and every parameter is covered; layout "hf" hands views to
  `load_weights` (stock loader over IPC).
- `load_nccl_weights`: `NcclWeights` from a trainer on another GPU over the group opened by
  `open_nccl_group`; received straight into the parameters' storage (or a scratch buffer, then
  copied), after the same name/shape/dtype cover check.

Copies write into the existing storage, so CUDA graphs and compiled code keep pointing at them.
Tensor parallel size 1 is assumed by the "vllm" layout (shapes are checked, so TP > 1 fails loudly).
"""

import time
import warnings

import torch

from oneloop.backends.megatron_local.weight_sync.ipc import CudaIpcWeights, load_ipc
from oneloop.backends.megatron_local.weight_sync.layout import (
    check_cover,
    dtype_from_name,
    dtype_name,
    unpack_flat,
)
from oneloop.backends.megatron_local.weight_sync.nccl import (
    TRANSFER_TIMEOUT_S,
    NcclWeights,
    broadcast_entries,
    open_group,
    wait_event,
)


class OneloopWorkerExtension:
    """Methods vLLM adds to its worker; `self` is the worker (has `get_model`, `device`)."""

    def _oneloop_params(self) -> dict[str, torch.nn.Parameter]:
        model = self.get_model()  # type: ignore[attr-defined]
        return dict(model.named_parameters())  # shared (tied) parameters appear once

    def _oneloop_device_index(self) -> int:
        device = getattr(self, "device", None)
        if isinstance(device, torch.device) and device.index is not None:
            return device.index
        return torch.cuda.current_device()

    def param_layout(self) -> list[list]:
        """`[name, dtype name, shape]` of every model parameter, in model order."""
        return [[n, dtype_name(p.dtype), list(p.shape)] for n, p in self._oneloop_params().items()]

    def weights_checksum(self) -> list[float]:
        """[sum, sum of |x|] over all parameters in float64 (tests compare sender and engine)."""
        total = absolute = 0.0
        for p in self._oneloop_params().values():
            d = p.detach().double()
            total += float(d.sum())
            absolute += float(d.abs().sum())
        return [total, absolute]

    def load_hf_weights(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], blobs: list[bytes]
    ) -> int:
        """Reference path: rebuild each tensor from bytes and call the model's `load_weights`."""
        if not len(names) == len(dtypes) == len(shapes) == len(blobs):
            raise ValueError("load_hf_weights: names, dtypes, shapes and blobs differ in length")
        device = torch.device("cuda", self._oneloop_device_index())
        tensors = []
        with warnings.catch_warnings():  # frombuffer on read-only bytes warns; we only read
            warnings.simplefilter("ignore", UserWarning)
            for name, dtype, shape, blob in zip(names, dtypes, shapes, blobs, strict=True):
                flat = torch.frombuffer(blob, dtype=torch.uint8)
                tensor = flat.view(dtype_from_name(dtype)).view(tuple(shape))
                tensors.append((name, tensor.to(device, non_blocking=False)))
        loaded = self.get_model().load_weights(tensors)  # type: ignore[attr-defined]
        torch.cuda.synchronize(device)
        return len(loaded) if loaded is not None else len(tensors)

    def load_ipc_weights(self, wire: dict) -> int:
        """Fast path (layout "vllm") or stock loader over IPC (layout "hf"); returns bytes read
        (`weight_sync.ipc.load_ipc`)."""
        model = self.get_model()  # type: ignore[attr-defined]
        return load_ipc(CudaIpcWeights.from_wire(wire), self._oneloop_device_index(), model)

    # -- NCCL from a trainer on another GPU --------------------------------------------------------

    def _oneloop_group(self, name: str):
        groups = getattr(self, "_oneloop_nccl", {})
        if name not in groups:
            raise ValueError(f"no NCCL weight group {name!r} (open it with open_nccl_group)")
        return groups[name]

    def open_nccl_group(self, name: str, host: str, port: int, world_size: int, rank: int) -> str:
        """Join the trainer's weight group `name` as `rank`; returns this GPU's UUID."""
        device = torch.device("cuda", self._oneloop_device_index())
        if not hasattr(self, "_oneloop_nccl"):
            self._oneloop_nccl = {}
        old = self._oneloop_nccl.pop(name, None)
        if old is not None:
            old.destroy()
        self._oneloop_nccl[name] = open_group(host, port, rank, world_size, device)
        return str(torch.cuda.get_device_properties(device).uuid)

    def load_nccl_weights(self, wire: dict) -> dict:
        """Receive one weight version (see `weight_sync.nccl.NcclWeights`); returns the bytes
        received and the transfer's GPU time in ms."""
        weights = NcclWeights.from_wire(wire)
        comm = self._oneloop_group(weights.group)
        params = self._oneloop_params()
        check_cover(params, weights.entries)
        stream = torch.cuda.current_stream(comm.device)
        began, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record(stream)
        with torch.no_grad():
            if weights.into == "params":
                targets = [params[e.name].data for e in weights.entries]
                entries = zip(weights.entries, targets, strict=True)
                strided = [e.name for e, t in entries if not t.is_contiguous()]
                if strided:
                    raise ValueError(f"cannot receive into non-contiguous parameters {strided[:4]}")
                broadcast_entries(comm, targets, stream)
            else:
                buffer = torch.empty(weights.nbytes, dtype=torch.uint8, device=comm.device)
                comm.broadcast(buffer, src=0, stream=stream)
                for name, view in unpack_flat(buffer, weights.entries):
                    params[name].data.copy_(view, non_blocking=True)
        done.record(stream)
        wait_event(done, comm, TRANSFER_TIMEOUT_S, f"receiving group {weights.group!r}")
        # GPU time from the receive's start to the last byte in place (copies included).
        return {"bytes": weights.nbytes, "transfer_ms": began.elapsed_time(done)}

    def nccl_bandwidth_probe(self, name: str, nbytes: int, iters: int) -> float:
        """Receive `iters` broadcasts of `nbytes` (the sender runs `NcclSender.bandwidth_probe`)."""
        comm = self._oneloop_group(name)
        stream = torch.cuda.current_stream(comm.device)
        buf = torch.empty(nbytes, dtype=torch.uint8, device=comm.device)
        comm.broadcast(buf, src=0, stream=stream)
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            comm.broadcast(buf, src=0, stream=stream)
        stream.synchronize()
        return time.perf_counter() - t0
