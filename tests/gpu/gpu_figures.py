"""Shared by the GPU tests: the device model directory, a figures sink ($OUT/<name>.json), the AdamW
parameters, the ragged batch the engine parity tests use and the layer specs this machine builds."""

import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "device" / "runbook"))

from build_random_qwen3 import build  # noqa: E402

from oneloop.backends.megatron_local.engines.base import DatumArrays  # noqa: E402

ADAM = dict(
    learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0
)
VOCAB = 151936  # the Qwen3 vocabulary of build_random_qwen3's shapes
LENGTHS = (512, 384, 300, 129, 512, 64, 200, 450)  # ragged: several microbatches, padding


def batch(seed: int, loss: str, lengths: tuple[int, ...] = LENGTHS) -> list[DatumArrays]:
    """Random datums for `loss` (`cross_entropy` weights, or `importance_sampling` inputs)."""
    rng = np.random.default_rng(seed)
    data = []
    for n in lengths:
        tokens = rng.integers(0, VOCAB, n + 1)
        inputs = {"weights": (rng.random(n) > 0.3).astype(np.float32)}
        if loss == "importance_sampling":
            inputs = {
                "logprobs": rng.normal(-11.0, 0.5, n).astype(np.float32),
                "advantages": rng.normal(0.0, 1.0, n).astype(np.float32),
            }
        data.append(DatumArrays(tokens[:-1], tokens[1:], inputs))
    return data


def model_dir(tmp_root: Path, shape: str = "0.6b", env: str = "ONELOOP_GPU_MODEL_DIR") -> Path:
    """The directory in `env` if set, else a random Qwen3 of `shape` built under `tmp_root`."""
    given = os.environ.get(env)
    return Path(given) if given else build(shape, tmp_root / f"qwen3-{shape}")


def record(name: str, figures: dict) -> None:
    """Print the figures and write them to $OUT/<name>.json when OUT is set."""
    text = json.dumps(figures, indent=1, sort_keys=True, default=float)
    print(f"FIGURES {name} {text}")
    out = os.environ.get("OUT")
    if out:
        Path(out, f"{name}.json").write_text(text)


def logprob_gaps(a, b) -> np.ndarray:
    """|Δ| of the per-token logprobs of two `ForwardResult`s, all datums concatenated."""
    return np.concatenate([np.abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)])


def layer_specs() -> list[str]:
    """Megatron layer specs to test here: `local` always, `te` where TransformerEngine imports."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return ["local"]
    return ["local", "te"]


def host_weights(weights: dict) -> dict:
    """Weights (torch or numpy) as fp32 host tensors in transformers' module layout (experts
    fused, as the torch engine holds them)."""
    import torch

    from oneloop.backends.megatron_local.engines.hf import fuse_experts

    return {k: torch.as_tensor(v).float().cpu() for k, v in fuse_experts(weights).items()}


def update_cosine(before: dict, after_a: dict, after_b: dict) -> float:
    """Cosine of two engines' updates from the same `before` weights, key by key on the host
    (a few billion weights never held as one vector)."""
    dot = norm_a = norm_b = 0.0
    for k in sorted(before):
        upd_a, upd_b = (after_a[k] - before[k]).double(), (after_b[k] - before[k]).double()
        dot += float((upd_a * upd_b).sum())
        norm_a += float((upd_a * upd_a).sum())
        norm_b += float((upd_b * upd_b).sum())
    return dot / (norm_a * norm_b) ** 0.5
