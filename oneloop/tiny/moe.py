"""Tiny random versions of the seed's model families: Qwen3-MoE, Qwen3.5/3.6 hybrid MoE (Gated
DeltaNet + gated attention, shared expert; text only) and Qwen3.5 dense (hybrid, no experts).

`oneloop.tiny.model.build_tiny_model` calls `model_config` / `write_model` here when
`TinyModelSpec.architecture` is not `qwen3`; the tokenizer and chat template are the tiny model's.
Every architecture is a transformers 5.x class that `AutoModelForCausalLM` loads from the
directory (`Qwen3MoeForCausalLM`, `Qwen3_5MoeForCausalLM` with `model_type`
`qwen3_5_moe_text`, `Qwen3_5ForCausalLM` with `qwen3_5_text`).

Spec fields map onto the configs: `intermediate_size` is the dense MLP's width (Qwen3.5 dense)
and each expert's width (MoE), `num_experts` / `experts_per_token` the router, and, in the hybrid
families, the Gated DeltaNet layers take `num_kv_heads` key heads and `num_heads` value heads of
`head_dim`. Hybrid layers follow Qwen3.5's pattern, three linear-attention layers to one full
attention layer, with the last layer always full attention so that every depth has one.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from oneloop.tiny.model import TinyModelSpec

ARCHITECTURES = ("qwen3", "qwen3_moe", "qwen3_5_moe", "qwen3_5")
"""`TinyModelSpec.architecture` values: the dense Qwen3 of `oneloop.tiny.model` and the three
families built here."""
MOE_ARCHITECTURES = ("qwen3_moe", "qwen3_5_moe")
FULL_ATTENTION_INTERVAL = 4


def hybrid_layer_types(num_layers: int) -> list[str]:
    """Qwen3.5's layer pattern (every 4th layer full attention), the last layer always full."""
    types = [
        "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
        for i in range(num_layers)
    ]
    types[-1] = "full_attention"
    return types


def model_config(spec: "TinyModelSpec", token_ids: dict[str, Any]) -> "PreTrainedConfig":
    """The transformers config of `spec` (architecture other than qwen3); `token_ids` holds
    `bos_token_id`, `eos_token_id`, `pad_token_id`."""
    common: dict[str, Any] = {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "dtype": "float32",
        **token_ids,
    }
    experts = {
        "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.experts_per_token,
        "moe_intermediate_size": spec.intermediate_size,
    }
    hybrid = {
        "layer_types": hybrid_layer_types(spec.num_layers),
        "linear_num_key_heads": spec.num_kv_heads,
        "linear_num_value_heads": spec.num_heads,
        "linear_key_head_dim": spec.head_dim,
        "linear_value_head_dim": spec.head_dim,
    }
    if spec.architecture == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **common,
            **experts,
            intermediate_size=spec.intermediate_size,
            norm_topk_prob=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if spec.architecture == "qwen3_5_moe":
        from transformers import Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig(
            **common, **experts, **hybrid, shared_expert_intermediate_size=spec.intermediate_size
        )
    if spec.architecture == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(**common, **hybrid, intermediate_size=spec.intermediate_size)
    raise ValueError(
        f"TinyModelSpec.architecture: expected one of {ARCHITECTURES[1:]} here, "
        f"got {spec.architecture!r}"
    )
