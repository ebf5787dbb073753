"""Expert parallelism on real megatron-core (CPU, gloo): the tiny Qwen3-MoE, imported through our
HF → Megatron mapping (`engines.megatron.moe`, experts sharded by `expert_shard`) into a GPTModel
with megatron-core 0.19's MoE layers (router in fp32, no aux / z loss, all-to-all dispatch), gives
the same loss and target logprobs at EP = 2 as at EP = 1, and both equal transformers' model.

Each EP size runs in its own processes (this file run as a script is one rank; the CUDA-on-CPU
shims of `megatron_cpu/cpu_megatron.py` stay there).
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
SEQ, ROWS = 24, 2


def _tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 1000, (ROWS, SEQ + 1))


def rank_main(model_dir: Path, ep: int, rank: int, port: int, out: Path) -> None:
    """One EP rank: build the MoE GPTModel, import the weights, forward + backward, save."""
    sys.path.insert(0, str(HERE / "megatron_cpu"))
    from cpu_megatron import cuda_calls_on_cpu, gloo_all_to_all

    cuda_calls_on_cpu(allocations=True)
    gloo_all_to_all()
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from oneloop.backends.megatron_local.engines.megatron.moe import (
        HybridShape,
        MoeSettings,
        expert_shard,
        hf_to_megatron,
    )
    from oneloop.backends.megatron_local.engines.megatron.speed import sdpa_core_attention

    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=ep, rank=rank
    )
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    shape = HybridShape.from_hf(AutoConfig.from_pretrained(model_dir))
    config = TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, ffn_hidden_size=shape.ffn,
        num_attention_heads=shape.heads, num_query_groups=shape.kv_heads,
        kv_channels=shape.head_dim, gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", layernorm_epsilon=1e-6, qk_layernorm=True,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        use_cpu_initialization=True, expert_model_parallel_size=ep,
        **MoeSettings().transformer_config_kwargs(shape),
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(
        num_experts=shape.experts, moe_grouped_gemm=False, qk_layernorm=True,
        normalization="RMSNorm",
    )  # fmt: skip
    spec.submodules.self_attention.submodules.core_attention = sdpa_core_attention()
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=shape.vocab,
        max_sequence_length=256, parallel_output=True,
        share_embeddings_and_output_weights=shape.tied, position_embedding_type="rope",
        rotary_base=10000,
    )  # fmt: skip
    hf = load_file(str(model_dir / "model.safetensors"))
    mega = expert_shard(shape, hf_to_megatron(shape, hf), ep, rank)
    params = dict(model.named_parameters())
    assert sorted(params) == sorted(mega), sorted(set(params) ^ set(mega))[:6]
    with torch.no_grad():
        for name, tensor in mega.items():
            params[name].copy_(tensor)
    data = torch.from_numpy(_tokens())
    tokens, targets = data[:, :-1], data[:, 1:]
    positions = torch.arange(SEQ)[None].expand(ROWS, -1)
    logits = model(tokens, positions, attention_mask=None)  # [b, s, v]
    lp = logits.float().log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    loss = -lp.sum()
    loss.backward()
    router = params["decoder.layers.0.mlp.router.weight"].grad
    np.savez(out, lp=lp.detach().numpy(), loss=float(loss), router_grad=router.detach().numpy())


def _run(model_dir: Path, sizes: tuple[int, ...], out_dir: Path) -> dict[int, list[Path]]:
    """Every rank of every EP size at once (one process each); their output files by size."""
    from oneloop.backends.megatron_local.ports import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outs, procs = {}, []
    for ep in sizes:
        port = free_port()
        outs[ep] = [out_dir / f"ep{ep}_rank{r}.npz" for r in range(ep)]
        procs += [
            subprocess.Popen(
                [sys.executable, __file__, str(model_dir), str(ep), str(r), str(port),
                 str(outs[ep][r])],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
            for r in range(ep)
        ]
    for proc in procs:
        output, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, output[-4000:]
    return outs


@pytest.mark.megatron_cpu
@pytest.mark.timeout(900)
def test_ep2_matches_ep1_and_transformers_on_gloo(tmp_path):
    pytest.importorskip("megatron.core")
    import torch
    from transformers import AutoModelForCausalLM

    from oneloop.tiny.model import TINY_QWEN3_MOE, build_tiny_model, named_tiny_specs

    model_dir = build_tiny_model(named_tiny_specs()[TINY_QWEN3_MOE])
    outs = _run(model_dir, (1, 2), tmp_path)
    one, two = np.load(outs[1][0]), [np.load(p) for p in outs[2]]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    data = torch.from_numpy(_tokens())
    with torch.no_grad():
        logits = hf(input_ids=data[:, :-1]).logits
    ref = logits.log_softmax(-1).gather(-1, data[:, 1:, None])[..., 0].numpy()
    figures = {
        "hf_vs_ep1_lp_max": float(np.abs(one["lp"] - ref).max()),
        "ep2_vs_ep1_lp_max": max(float(np.abs(t["lp"] - one["lp"]).max()) for t in two),
        "ep2_vs_ep1_loss": max(abs(float(t["loss"]) - float(one["loss"])) for t in two),
        "ep2_vs_ep1_router_grad_max": max(
            float(np.abs(t["router_grad"] - one["router_grad"]).max()) for t in two
        ),
    }
    print("RESULT moe_ep_gloo", figures)
    assert figures["hf_vs_ep1_lp_max"] < 1e-4, figures
    assert figures["ep2_vs_ep1_lp_max"] < 1e-5, figures
    assert figures["ep2_vs_ep1_loss"] < 1e-3, figures
    assert figures["ep2_vs_ep1_router_grad_max"] < 1e-5, figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for name in ("model_dir", "ep", "rank", "port", "out"):
        parser.add_argument(name)
    a = parser.parse_args()
    rank_main(Path(a.model_dir), int(a.ep), int(a.rank), int(a.port), Path(a.out))
