"""Weights in vLLM's parameter layout, packed into one flat buffer (IPC and NCCL both carry it).

This module owns the layout half of the vLLM fast weight path (pure torch, no vLLM import):
- `hf_to_vllm_layout`: Hugging Face names → vLLM's fused parameters, following the
  `packed_modules_mapping` of vLLM's Qwen2/Qwen3/Llama models: `qkv_proj = cat(q, k, v)` and
  `gate_up_proj = cat(gate, up)` on dim 0 (tensor parallel size 1: one rank holds every shard);
  a tied `lm_head` has no parameter of its own in vLLM (it *is* `embed_tokens`), an untied one is
  copied; a vocabulary padded by vLLM's embedding is zero-padded. Mixture-of-experts layers
  (Qwen3-MoE) hold every expert of a layer in two `FusedMoE` parameters: `experts.w13_weight`
  [E, 2·F, H] (expert j's gate rows, then its up rows) and `experts.w2_weight` [E, H, F] (down),
  built from the checkpoint's per-expert tensors (`experts.{j}.gate_proj.weight`, ...) or from
  transformers' fused `experts.gate_up_proj` / `experts.down_proj`.
- `pack_flat`: those tensors into one contiguous uint8 buffer, each entry aligned to
  `ALIGN_BYTES`, so a receiver views every parameter out of one allocation; `unpack_flat` and the
  entries' plain msgpack wire form (`entries_to_wire` / `entries_from_wire`).
- `check_cover`: the receiver's check that sent entries match its parameters one to one.
The transports are `weight_sync.ipc` (same GPU) and `weight_sync.nccl` (another GPU).

The layout itself — `(name, dtype, shape)` for every vLLM parameter — comes from the engine's worker
(`OneloopWorkerExtension.param_layout`), so the packer never guesses vLLM's names.
"""

import re
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


# vLLM FusedMoE parameter → (per-expert projections concatenated per expert, transformers' fused
# name for the same tensor). vLLM 0.26 names them `<layer>.mlp.experts.routed_experts.w13_weight`
# (the experts module wraps its FusedMoE); older releases drop `routed_experts.`.
FUSED_MOE = re.compile(r"^(.*\.mlp\.experts)\.(?:routed_experts\.)?(w13_weight|w2_weight)$")
EXPERTS = {
    "w13_weight": (("gate_proj", "up_proj"), "gate_up_proj"),
    "w2_weight": (("down_proj",), "down_proj"),
}


def _expert_sources(name: str, hf: dict[str, torch.Tensor], experts: int) -> list[str]:
    """The Hugging Face tensors of FusedMoE parameter `name` of `experts` experts
    (expert-major, projections in concatenation order)."""
    match = FUSED_MOE.match(name)
    assert match is not None, name
    head, (parts, fused) = match.group(1), EXPERTS[match.group(2)]
    if f"{head}.{fused}" in hf:  # transformers' module layout: already [E, ...]
        return [f"{head}.{fused}"]
    return [f"{head}.{j}.{part}.weight" for j in range(experts) for part in parts]


def _combine(parts: list[torch.Tensor], experts: int | None) -> torch.Tensor:
    """One vLLM parameter from its sources: concatenated on dim 0, or for a FusedMoE parameter
    built from per-expert tensors, each expert's projections concatenated, then stacked."""
    if len(parts) == 1:
        return parts[0]
    if experts is None:
        return torch.cat(parts, dim=0)
    per = len(parts) // experts
    rows = [parts[j * per : (j + 1) * per] for j in range(experts)]
    return torch.stack([r[0] if per == 1 else torch.cat(r, dim=0) for r in rows])


def _sources(name: str, hf: dict[str, torch.Tensor]) -> list[str]:
    """The Hugging Face tensors that make vLLM parameter `name`, in concatenation order."""
    for fused, parts in FUSED.items():
        marker = f".{fused}."
        if marker in name:
            return [name.replace(marker, f".{part}.") for part in parts]
    if name == LM_HEAD and LM_HEAD not in hf:
        return [EMBED]  # untied in vLLM but tied in the checkpoint
    return [name]


# vLLM parameters this module cannot build yet: the Gated DeltaNet layers of Qwen3.5 / 3.6
# (vLLM fuses and reshapes their projections and convolution its own way). Their weights reach
# vLLM through its own loader (`local.weight_sync: object_store`).
UNMAPPED = (".linear_attn.",)


def fast_path_gap(layout: ParamLayout) -> str | None:
    """Why `hf_to_vllm_layout` cannot build `layout` (parameters it has no mapping for), or None."""
    unmapped = [name for name, _, _ in layout if any(part in name for part in UNMAPPED)]
    if not unmapped:
        return None
    return (
        f"the CUDA weight path has no mapping for vLLM's Gated DeltaNet parameters "
        f"({len(unmapped)}, e.g. {unmapped[0]})"
    )


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
        fused_moe = len(shape) == 3 and FUSED_MOE.match(name) is not None
        experts = int(shape[0]) if fused_moe else None
        sources = _expert_sources(name, hf, experts) if experts else _sources(name, hf)
        missing = [s for s in sources if s not in hf]
        if missing:
            shown = missing[:4] + ([f"... {len(missing) - 4} more"] if len(missing) > 4 else [])
            problems.append(f"{name}: missing Hugging Face tensor(s) {shown}")
            continue
        used.update(sources)
        tensor = _combine([hf[s] for s in sources], experts)
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


def check_cover(params: dict[str, torch.nn.Parameter], entries: Sequence[FlatEntry]) -> None:
    """Every entry names a parameter of the same shape and dtype, and every parameter is covered."""
    problems = []
    seen = set()
    for e in entries:
        p = params.get(e.name)
        if p is None:
            problems.append(f"{e.name}: no such vLLM parameter")
        elif tuple(p.shape) != tuple(e.shape) or dtype_name(p.dtype) != e.dtype:
            problems.append(
                f"{e.name}: sent {e.dtype}{list(e.shape)}, "
                f"vLLM has {dtype_name(p.dtype)}{list(p.shape)}"
            )
        seen.add(e.name)
    uncovered = sorted(set(params) - seen)
    if uncovered:
        problems.append(
            f"vLLM parameters not sent: {uncovered[:8]}"
            + (f" (+{len(uncovered) - 8} more)" if len(uncovered) > 8 else "")
        )
    if problems:
        raise ValueError(
            "the sent weights do not match the engine's parameters "
            "(pack them with the layout from param_layout()): " + "; ".join(problems)
        )
