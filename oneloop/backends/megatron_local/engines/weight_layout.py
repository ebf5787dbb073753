"""Weights in vLLM's parameter layout, packed into one flat buffer, shared over CUDA IPC.

This module owns the trainer-side half of the vLLM fast weight path (pure torch, no vLLM import):
- `hf_to_vllm_layout`: Hugging Face names → vLLM's fused parameters, following the
  `packed_modules_mapping` of vLLM's Qwen2/Qwen3/Llama models: `qkv_proj = cat(q, k, v)` and
  `gate_up_proj = cat(gate, up)` on dim 0 (tensor parallel size 1: one rank holds every shard);
  a tied `lm_head` has no parameter of its own in vLLM (it *is* `embed_tokens`), an untied one is
  copied; a vocabulary padded by vLLM's embedding is zero-padded.
- `pack_flat`: those tensors into one contiguous uint8 buffer, each entry aligned to
  `ALIGN_BYTES`, so a receiver views every parameter out of one allocation.
- `make_ipc_weights` / `CudaIpcWeights`: a CUDA IPC handle of that buffer plus its entries, as a
  frozen dataclass that travels as plain msgpack types (`to_wire` / `from_wire`), so vLLM's RPC
  channel carries it without pickle. The receiver maps the buffer on its own device (the sender's
  device index is meaningless there; the GPU UUID is checked instead).

The layout itself — `(name, dtype, shape)` for every vLLM parameter — comes from the engine's worker
(`OneloopWorkerExtension.param_layout`), so the packer never guesses vLLM's names.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# 256 bytes: every entry starts on a boundary that suits any dtype view and coalesced copies.
ALIGN_BYTES = 256

ParamLayout = Sequence[tuple[str, str, Sequence[int]]]  # (vLLM name, dtype name, shape)

FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


def dtype_from_name(name: str) -> torch.dtype:
    """`"bfloat16"` or `"torch.bfloat16"` → `torch.bfloat16`; a clear error otherwise."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype name {name!r} (expected e.g. 'bfloat16')")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sources(name: str, hf: dict[str, torch.Tensor]) -> list[str]:
    """The Hugging Face tensors that make vLLM parameter `name`, in concatenation order."""
    for fused, parts in FUSED.items():
        marker = f".{fused}."
        if marker in name:
            return [name.replace(marker, f".{part}.") for part in parts]
    if name == LM_HEAD and LM_HEAD not in hf:
        return [EMBED]  # untied in vLLM but tied in the checkpoint
    return [name]


def hf_to_vllm_layout(
    hf: dict[str, torch.Tensor], layout: ParamLayout
) -> list[tuple[str, torch.Tensor]]:
    """Build every parameter of `layout` from the Hugging Face state dict `hf`.

    Returns `(vLLM name, tensor)` in layout order, each with the layout's dtype and shape. Raises
    ValueError listing every missing source, shape mismatch and unused Hugging Face tensor.
    """
    out: list[tuple[str, torch.Tensor]] = []
    used: set[str] = set()
    problems: list[str] = []
    for name, dtype_str, shape in layout:
        sources = _sources(name, hf)
        missing = [s for s in sources if s not in hf]
        if missing:
            problems.append(f"{name}: missing Hugging Face tensor(s) {missing}")
            continue
        used.update(sources)
        parts = [hf[s] for s in sources]
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        want = tuple(int(d) for d in shape)
        if name in (EMBED, LM_HEAD) and len(want) == 2 and tensor.shape[1:] == want[1:]:
            pad = want[0] - tensor.shape[0]
            if pad > 0:  # vLLM pads the vocabulary to a multiple of its padding size
                tensor = torch.cat([tensor, tensor.new_zeros(pad, tensor.shape[1])], dim=0)
        if tuple(tensor.shape) != want:
            problems.append(
                f"{name}: built shape {tuple(tensor.shape)} from {sources}, vLLM expects {want}"
            )
            continue
        out.append((name, tensor.to(dtype_from_name(dtype_str)).contiguous()))
    # A tied checkpoint may still list lm_head; rotary inv_freq is a buffer vLLM recomputes.
    unused = sorted(n for n in set(hf) - used - {LM_HEAD} if not n.endswith("rotary_emb.inv_freq"))
    if unused:
        problems.append(
            f"Hugging Face tensors with no vLLM parameter: {unused[:8]}"
            + (f" (+{len(unused) - 8} more)" if len(unused) > 8 else "")
        )
    if problems:
        raise ValueError("weights do not fit the vLLM parameter layout: " + "; ".join(problems))
    return out


@dataclass(frozen=True)
class FlatEntry:
    """One parameter inside a flat buffer: `offset` in bytes from the buffer's start."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * dtype_from_name(self.dtype).itemsize


def pack_flat(
    named_tensors: Sequence[tuple[str, torch.Tensor]], device: torch.device | str
) -> tuple[torch.Tensor, list[FlatEntry]]:
    """Copy `named_tensors` into one uint8 buffer on `device`; returns it with the entries."""
    entries: list[FlatEntry] = []
    offset = 0
    for name, tensor in named_tensors:
        entry = FlatEntry(name, dtype_name(tensor.dtype), tuple(tensor.shape), offset)
        entries.append(entry)
        offset += -(-entry.nbytes // ALIGN_BYTES) * ALIGN_BYTES
    buffer = torch.empty(offset, dtype=torch.uint8, device=device)
    for entry, (_, tensor) in zip(entries, named_tensors, strict=True):
        view_of(buffer, entry).copy_(tensor)
    return buffer, entries


def view_of(buffer: torch.Tensor, entry: FlatEntry) -> torch.Tensor:
    """The tensor `entry` names, as a view into `buffer` (no copy)."""
    if entry.offset % ALIGN_BYTES or entry.offset + entry.nbytes > buffer.numel():
        raise ValueError(
            f"entry {entry.name} (offset {entry.offset}, {entry.nbytes} B) does not "
            f"fit an aligned slot of a {buffer.numel()} B buffer"
        )
    raw = buffer[entry.offset : entry.offset + entry.nbytes]
    return raw.view(dtype_from_name(entry.dtype)).view(entry.shape)


def entries_to_wire(entries: Sequence[FlatEntry]) -> list[list]:
    """Entries as plain msgpack lists `[name, dtype, shape, offset]` (IPC and NCCL wire forms)."""
    return [[e.name, e.dtype, list(e.shape), e.offset] for e in entries]


def entries_from_wire(rows: Sequence[Sequence]) -> tuple[FlatEntry, ...]:
    return tuple(FlatEntry(str(n), str(d), tuple(int(x) for x in s), int(o)) for n, d, s, o in rows)


def unpack_flat(
    buffer: torch.Tensor, entries: Sequence[FlatEntry]
) -> list[tuple[str, torch.Tensor]]:
    """Views of every entry (the inverse of `pack_flat`)."""
    return [(e.name, view_of(buffer, e)) for e in entries]


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
