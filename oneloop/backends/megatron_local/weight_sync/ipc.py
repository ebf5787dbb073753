"""Weight sync over CUDA IPC: a trainer and a vLLM engine on the same GPU.

This module owns both halves of the same-GPU transport (pure torch, no vLLM import):
- sender: `make_ipc_weights` / `pack_for_engine` share a flat buffer (`layout.pack_flat`) as a
  CUDA IPC handle plus its entries: `CudaIpcWeights`, a frozen dataclass that travels as plain
  msgpack types (`to_wire` / `from_wire`), so vLLM's RPC channel carries it without pickle.
  The sender keeps the buffer alive until the receiver's load returns.
- receiver: `load_ipc` (called by the vLLM worker extension) maps the buffer on its own device
  (the sender's device index is meaningless there; the GPU UUID is checked instead) and copies
  every entry straight into its parameter's storage, or hands the views to the model's own
  `load_weights` (layout "hf", the stock loader, for comparison).
- `gpu_uuid`: which GPU a process runs on, so the publisher picks IPC (same GPU) or NCCL.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from oneloop.backends.megatron_local.weight_sync.layout import (
    FlatEntry,
    ParamLayout,
    check_cover,
    dtype_from_name,
    dtype_name,
    entries_from_wire,
    entries_to_wire,
    hf_to_vllm_layout,
    pack_flat,
    unpack_flat,
)


@dataclass(frozen=True)
class CudaIpcWeights:
    """A flat weight buffer shared over CUDA IPC, with its entries, for one weight version.

    `layout` says how the receiver loads it: "vllm" = entries are vLLM parameters, copied straight
    into their storage; "hf" = entries are Hugging Face tensors handed to the model's own
    `load_weights` (the stock per-layer loader, for comparison). The sender must keep the buffer
    alive until the load call returns.
    """

    handle: tuple  # rebuild_cuda_tensor arguments minus the two class objects (see to_wire)
    storage_typed: bool  # reduce_tensor shared a TypedStorage (True) or an UntypedStorage
    gpu_uuid: str
    nbytes: int
    entries: tuple[FlatEntry, ...]
    version: int
    layout: str = "vllm"

    def to_wire(self) -> dict:
        """Plain msgpack types only (vLLM's RPC refuses pickle unless told otherwise)."""
        return {
            "handle": [list(x) if isinstance(x, tuple | torch.Size) else x for x in self.handle],
            "storage_typed": self.storage_typed,
            "gpu_uuid": self.gpu_uuid,
            "nbytes": self.nbytes,
            "entries": entries_to_wire(self.entries),
            "version": self.version,
            "layout": self.layout,
        }

    @classmethod
    def from_wire(cls, wire: dict) -> "CudaIpcWeights":
        handle = list(wire["handle"])
        handle[0], handle[1] = tuple(handle[0]), tuple(handle[1])  # size, stride
        return cls(
            handle=tuple(handle),
            storage_typed=bool(wire["storage_typed"]),
            gpu_uuid=str(wire["gpu_uuid"]),
            nbytes=int(wire["nbytes"]),
            entries=entries_from_wire(wire["entries"]),
            version=int(wire["version"]),
            layout=str(wire["layout"]),
        )

    def open(self, device_index: int) -> torch.Tensor:
        """Map the shared buffer on this process's `device_index` (receiver side)."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        own = str(torch.cuda.get_device_properties(device_index).uuid)
        if own != self.gpu_uuid:
            raise ValueError(
                f"CUDA IPC weights live on GPU {self.gpu_uuid}, this worker runs on "
                f"{own}: IPC needs the sender and the engine on the same GPU"
            )
        size, stride, offset, dtype, _device, *rest = self.handle
        storage_cls = torch.storage.TypedStorage if self.storage_typed else torch.UntypedStorage
        return rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size(size),
            tuple(stride),
            offset,
            storage_cls,
            dtype_from_name(dtype),
            device_index,
            *rest,
        )


def gpu_uuid() -> str | None:
    """The UUID of this process's current CUDA device, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def make_ipc_weights(
    buffer: torch.Tensor, entries: Sequence[FlatEntry], version: int, layout: str = "vllm"
) -> CudaIpcWeights:
    """Share `buffer` (a CUDA uint8 tensor from `pack_flat`) over CUDA IPC."""
    from torch.multiprocessing.reductions import reduce_tensor

    if buffer.device.type != "cuda" or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(
            f"make_ipc_weights needs a 1-D CUDA uint8 buffer, got {buffer.dtype} "
            f"{tuple(buffer.shape)} on {buffer.device}"
        )
    if layout not in ("vllm", "hf"):
        raise ValueError(f"layout must be 'vllm' or 'hf', got {layout!r}")
    # The receiver reads on its own stream: the bytes must be written before the handle leaves.
    torch.cuda.current_stream(buffer.device).synchronize()
    _rebuild, args = reduce_tensor(buffer.detach())
    _tensor_cls, size, stride, offset, storage_cls, dtype, device, *rest = args
    uuid = str(torch.cuda.get_device_properties(buffer.device).uuid)
    return CudaIpcWeights(
        handle=(tuple(size), tuple(stride), offset, dtype_name(dtype), device, *rest),
        storage_typed=storage_cls is not torch.UntypedStorage,
        gpu_uuid=uuid,
        nbytes=buffer.numel(),
        entries=tuple(entries),
        version=version,
        layout=layout,
    )


def pack_for_engine(
    hf: dict[str, torch.Tensor], layout: ParamLayout, device: torch.device | str, version: int
) -> tuple[torch.Tensor, CudaIpcWeights]:
    """Hugging Face tensors → vLLM layout → one CUDA buffer → its IPC handle.

    Returns the buffer too: the caller keeps it alive until the engine's `set_weights` returns.
    """
    buffer, entries = pack_flat(hf_to_vllm_layout(hf, layout), device)
    return buffer, make_ipc_weights(buffer, entries, version)


def load_ipc(weights: CudaIpcWeights, device_index: int, model: torch.nn.Module) -> int:
    """Receiver side: load `weights` into `model` (a vLLM model) on `device_index`; layout "vllm"
    copies each entry straight into its parameter's storage (`param.data.copy_`), after checking
    that names, shapes and dtypes match and every parameter is covered; layout "hf" hands views to
    `model.load_weights` (stock loader over IPC). Returns the bytes read."""
    buffer = weights.open(device_index)
    if buffer.numel() < weights.nbytes:
        raise ValueError(f"IPC buffer holds {buffer.numel()} B, entries need {weights.nbytes}")
    views = unpack_flat(buffer, weights.entries)
    if weights.layout == "hf":
        model.load_weights(views)  # type: ignore[operator]  (vLLM models have it)
    elif weights.layout == "vllm":
        params = dict(model.named_parameters())  # shared (tied) parameters appear once
        check_cover(params, weights.entries)
        with torch.no_grad():
            for name, view in views:
                params[name].data.copy_(view, non_blocking=True)
    else:
        raise ValueError(f"unknown CudaIpcWeights.layout {weights.layout!r}")
    torch.cuda.synchronize(device_index)
    del views, buffer  # release the IPC mapping before the sender may free it
    return weights.nbytes
