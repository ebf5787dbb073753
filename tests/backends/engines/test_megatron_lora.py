"""The `megatron` engine's LoRA math (`engines/megatron/lora.py`) on CPU, without megatron-core.

The engine itself (GPTModel, DDP, optimizer) runs in tests/gpu/test_megatron_engine.py; here the
adapters' placement in Megatron's fused outputs is checked against `megatron.layout`'s own weight
mapping: the fused delta an adapter adds to `linear_qkv` / `linear_fc1` must be the output of the
merged HF weights mapped to Megatron's layout.
"""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from oneloop.backends.megatron_local.engines.base import LoraSpec
from oneloop.backends.megatron_local.engines.megatron import lora as megatron_lora
from oneloop.backends.megatron_local.engines.megatron.layout import DenseShape, hf_to_megatron
from oneloop.errors import CapabilityError

FUSED = {
    "self_attention.linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "mlp.linear_fc1": ("mlp", ("gate_proj", "up_proj")),
}


def _random_deltas(shape: DenseShape, rank: int) -> dict[str, megatron_lora.LoraDelta]:
    """Adapters of layer 0's fused linears with non-zero B (B = 0 at init would hide the layout)."""
    generator = torch.Generator().manual_seed(0)
    dims = megatron_lora.target_dims(shape)
    deltas = {}
    for site, (_, targets) in FUSED.items():
        delta = megatron_lora.LoraDelta(
            {t: dims[t] for t in targets},
            rank,
            megatron_lora.delta_fuser(shape, targets),
            generator,
            torch.device("cpu"),
        )
        with torch.no_grad():
            for b in delta.lora_B.values():
                b.normal_(generator=generator)
        deltas[site] = delta
    return deltas


def test_fused_deltas_follow_megatron_layout(tiny_model_path) -> None:
    shape = DenseShape.from_hf(AutoConfig.from_pretrained(str(tiny_model_path)))
    assert shape.heads != shape.kv_heads  # grouped queries: the interleave matters
    hf = load_file(str(tiny_model_path / "model.safetensors"))
    hf.setdefault("lm_head.weight", hf["model.embed_tokens.weight"])
    deltas = _random_deltas(shape, rank=4)
    by_hf = {
        f"model.layers.0.{FUSED[site][0]}.{target}": (delta, target)
        for site, delta in deltas.items()
        for target in FUSED[site][1]
    }
    lora = megatron_lora.MegatronLora(LoraSpec(4), "", by_hf)
    base, merged = hf_to_megatron(shape, hf), hf_to_megatron(shape, lora.merge(hf))
    x = torch.randn(5, 2, shape.hidden)  # Megatron's [sequence, batch, hidden]
    for site, delta in deltas.items():
        name = f"decoder.layers.0.{site}.weight"
        fused_delta_weight = merged[name] - base[name].float()
        with torch.no_grad():
            expected = x @ fused_delta_weight.T
            got = delta(x)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        assert expected.abs().max() > 1e-2
    untouched = "model.layers.0.self_attn.o_proj.weight"
    assert lora.merge(hf)[untouched] is hf[untouched]


def test_adapter_export_round_trips_and_checks_rank(tiny_model_path) -> None:
    shape = DenseShape.from_hf(AutoConfig.from_pretrained(str(tiny_model_path)))
    deltas = _random_deltas(shape, rank=4)
    by_hf = {
        f"model.layers.0.self_attn.{t}": (deltas["self_attention.linear_qkv"], t)
        for t in ("q_proj", "k_proj", "v_proj")
    }
    lora = megatron_lora.MegatronLora(LoraSpec(4), "", by_hf)
    adapter = lora.adapter()
    assert adapter.target_modules == ("k_proj", "q_proj", "v_proj")
    assert adapter.alpha == 32 and all(v.dtype == np.float32 for v in adapter.tensors.values())
    assert adapter.tensors[
        "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"
    ].shape == (
        shape.kv_heads * shape.head_dim,
        4,
    )
    before = {k: v.copy() for k, v in adapter.tensors.items()}
    with torch.no_grad():
        for b in deltas["self_attention.linear_qkv"].lora_B.values():
            b.zero_()
    lora.load_adapter(adapter)
    assert all(np.array_equal(lora.adapter().tensors[k], v) for k, v in before.items())
    wrong_rank = megatron_lora.MegatronLora(LoraSpec(8), "", by_hf)
    with pytest.raises(ValueError, match="rank"):
        wrong_rank.load_adapter(adapter)


def test_lora_refuses_empty_targets() -> None:
    shape = DenseShape("qwen3", 1, 8, 16, 2, 1, 4, 32, True, False, True, 1e4, 1e-6, 64)
    nothing = LoraSpec(4, train_mlp=False, train_attn=False, train_unembed=False)
    with pytest.raises(ValueError, match="at least one"):
        megatron_lora.inject(torch.nn.Module(), shape, nothing, tp=1, base_model_path="")
    assert megatron_lora.is_lora_name("decoder.layers.0.mlp.linear_fc1.lora.lora_A.gate_proj")
    assert not megatron_lora.is_lora_name("decoder.layers.0.mlp.linear_fc1.weight")


def test_local_backend_offers_megatron_lora_at_tp_but_not_pp_or_cp() -> None:
    from oneloop.backends import capabilities
    from oneloop.backends.config import parse_backend_config

    for sizes, offered in (
        ({"tp": 1}, True),
        ({"tp": 2}, True),
        ({"pp": 2}, False),
        ({"cp": 2}, False),
    ):
        config = parse_backend_config(
            {"backend": "local", "local": {"trainer_engine": "megatron", "megatron": sizes}}
        )
        table = capabilities(config)
        if offered:
            table.check(lora_rank=16)
        else:
            with pytest.raises(CapabilityError, match="LoRA"):
                table.check(lora_rank=16)
        table.check(lora_rank=0)
