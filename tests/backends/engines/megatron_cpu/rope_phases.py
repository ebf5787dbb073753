"""The phases of the megatron engine's RoPE-scaling check (test_megatron_rope_scaling).

    .venv/bin/python tests/backends/engines/megatron_cpu/rope_phases.py --phase torch --work DIR
    .venv/bin/python tests/backends/engines/megatron_cpu/rope_phases.py --phase megatron --work DIR

A tiny random Llama with Llama 3's `llama3` RoPE scaling (factor 8, the fixed values Llama 3.1 /
3.2 / 3.3 ship, Llama 3's RoPE base) and the same weights with plain RoPE, fp32, sequences of up
to 1,000 tokens (where the scaled low frequencies have turned measurably apart):
- phase `torch` (its own process, no CUDA-on-CPU shims): the torch trainer engine's target
  logprobs for both models (transformers' own RoPE scaling);
- phase `megatron` (the shims installed at the top): the megatron engine's logprobs for the scaled
  model (megatron-core's RotaryEmbedding with rope_scaling), and its refusal of `fused_rope` there.
Each writes DIR/<phase>.npz (and the megatron phase DIR/refusal.txt).
"""

import argparse
import json
import sys
from pathlib import Path

import cpu_megatron as cm
import numpy as np

if __name__ == "__main__" and "megatron" in sys.argv:
    cm.cuda_calls_on_cpu(allocations=True)

LENGTHS = (1000, 400, 77)
BUDGET = 2048
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}  # fmt: skip


def build(work: Path) -> dict[str, Path]:
    """The two model directories (`scaled`, `plain`): the same random weights (seed 0)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dirs = {"scaled": work / "llama3-scaled", "plain": work / "llama3-plain"}
    if (dirs["plain"] / "config.json").is_file():
        return dirs
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=500000.0,
                  max_position_embeddings=16384, tie_word_embeddings=False)  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(rope_scaling=dict(LLAMA3), **common))
    model.save_pretrained(dirs["scaled"])
    model.config = LlamaConfig(**common)
    model.save_pretrained(dirs["plain"])
    return dirs


def _data():
    return cm.random_data(np.random.default_rng(3), LENGTHS, cm.ones)


def _logprobs(engine) -> np.ndarray:
    result = engine.forward_backward(_data(), "cross_entropy", None, forward_only=True)
    return np.concatenate(result.logprobs)


def _run_torch(work: Path) -> None:
    from oneloop.backends.megatron_local.engines.base import LoraSpec
    from oneloop.backends.megatron_local.engines.torch.trainer import TorchTrainerEngine

    out = {}
    for name, model in build(work).items():
        engine = TorchTrainerEngine(model, LoraSpec(0), device="cpu", dtype="float32", threads=1,
                                    max_tokens_per_microbatch=BUDGET)  # fmt: skip
        out[name] = _logprobs(engine)
    np.savez(work / "torch.npz", **out)


def _run_megatron(work: Path) -> None:
    from oneloop.backends.megatron_local.engines.base import LoraSpec
    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronParallel
    from oneloop.errors import CapabilityError

    model = build(work)["scaled"]
    kwargs = dict(dtype="float32", device="cpu", threads=1, parallel=MegatronParallel(),
                  max_tokens_per_microbatch=BUDGET)  # fmt: skip
    engine, _ = cm.make_engine(model, LoraSpec(0), group=False, **kwargs)
    np.savez(work / "megatron.npz", scaled=_logprobs(engine))
    try:
        cm.make_engine(model, LoraSpec(0), group=False, speed=cm.check_speed(fused_rope=True),
                       **kwargs)  # fmt: skip
        refusal = "built"
    except CapabilityError as error:
        refusal = str(error)
    (work / "refusal.txt").write_text(json.dumps(refusal))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--phase", choices=("torch", "megatron"), required=True)
    parser.add_argument("--work", type=Path, required=True)
    args = parser.parse_args()
    (_run_torch if args.phase == "torch" else _run_megatron)(args.work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
