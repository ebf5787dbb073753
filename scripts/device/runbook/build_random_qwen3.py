"""Build a random-weight Qwen3 of a real shape on the device (no hub there): `--shape 0.6b|1.7b`,
or `30b-a3b-4l`: Qwen3-30B-A3B's width (hidden 2048, 32 query / 4 KV heads of 128, 128 experts
top-8 of width 768, untied) at 4 layers (3.1 B parameters, `qwen3_moe`; `30b-a3b`: all 48, config
only with `--config-only`), or `35b-a3b-4l`:
Qwen3.6-35B-A3B's text width (transformers' `Qwen3_5MoeTextConfig` defaults: hidden 2048, 256
experts top-8 of width 512 and a shared expert, Gated DeltaNet 3 : 1 gated attention, vocabulary
248,320) at 4 layers (`qwen3_5_moe_text`).

Timings on such a model are representative; its text is not. Writes a Hugging Face directory
(config, generation config, bf16 safetensors) that every engine loads like a downloaded model.
"""

import argparse
from pathlib import Path

import torch
from transformers import (
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

# Published Qwen3 shapes (config.json of Qwen/Qwen3-0.6B and Qwen/Qwen3-1.7B).
SHAPES = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8),
}  # fmt: skip
MOE_SHAPES = {  # config.json of Qwen/Qwen3-30B-A3B, 4 of its 48 layers
    "30b-a3b-4l": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=4,
                       num_attention_heads=32, num_key_value_heads=4, moe_intermediate_size=768,
                       num_experts=128, num_experts_per_tok=8, norm_topk_prob=True),
    # All 48 layers (30.5 B parameters, 61 GB in bf16): build it with --config-only and serve
    # it with vLLM's load_format="dummy" (random weights made on the GPU, nothing on disk).
    "30b-a3b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                    num_attention_heads=32, num_key_value_heads=4, moe_intermediate_size=768,
                    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True),
    # The same layers with 32 of the 128 experts (top-8 kept): real attention and expert widths,
    # small enough for the whole local backend on one GPU with two trainers (the e2e test).
    "30b-a3b-4l-32e": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=4,
                           num_attention_heads=32, num_key_value_heads=4, moe_intermediate_size=768,
                           num_experts=32, num_experts_per_tok=8, norm_topk_prob=True),
}  # fmt: skip
HYBRID_SHAPES = {  # Qwen3.6-35B-A3B's text model (the config class defaults), 4 of its 40 layers
    "35b-a3b-4l": dict(
        num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"]
    ),
    # The same layers with 32 of the 256 experts (top-8 kept): real GDN, attention and expert widths
    # in a model small enough for a device call of a few minutes (a smoke run of the GPU path).
    "35b-a3b-4l-32e": dict(
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_experts=32,
    ),
}


def build(shape: str, out: Path, seed: int = 0, config_only: bool = False) -> Path:
    if (out / "config.json").is_file():
        return out
    if shape in MOE_SHAPES:
        config, model_class = Qwen3MoeConfig(
            vocab_size=151936, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
            tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
            **MOE_SHAPES[shape],
        ), Qwen3MoeForCausalLM  # fmt: skip
    elif shape in HYBRID_SHAPES:
        config = Qwen3_5MoeTextConfig(tie_word_embeddings=False, **HYBRID_SHAPES[shape])
        model_class = Qwen3_5MoeForCausalLM
    else:
        config, model_class = _dense_config(shape), Qwen3ForCausalLM
    if config_only:  # for vLLM's load_format="dummy"
        config.dtype, config.architectures = torch.bfloat16, [model_class.__name__]
        config.save_pretrained(out)
        return out
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = model_class(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def _dense_config(shape: str) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=151936, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
        **SHAPES[shape],
    )  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    shapes = sorted(SHAPES) + sorted(MOE_SHAPES) + sorted(HYBRID_SHAPES)
    parser.add_argument("--shape", choices=shapes, default="0.6b")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--config-only", action="store_true", help="config.json only (vLLM load_format=dummy)"
    )
    args = parser.parse_args()
    print(build(args.shape, args.out, config_only=args.config_only))
