"""The `megatron` trainer at CP = 2 (two GPUs, `megatron.group`, no TransformerEngine) against
CP = 1, same random Qwen3 (0.6 B shape, bf16) at long sequences (4096 tokens plus ragged lengths
that are not multiples of 2·cp): forward_backward loss and target logprobs, grad norm and the update
after one optim_step (cosine in float64), forward_only after the step, save/load restore.

CP = 1 runs first in a subprocess (torch.distributed is one world per process; this file run as a
script is that subprocess), then CP = 2 in the test process. Device only, nvidia-h200-x2:
`pytest -m gpu tests/gpu/test_megatron_cp.py` (gpu_run.sh stage `cp`). Figures →
$OUT/megatron_cp.json.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs (nvidia-h200-x2)", allow_module_level=True)

from gpu_figures import ADAM, batch, logprob_gaps, model_dir, record  # noqa: E402

from oneloop.backends.megatron_local.engines.base import LoraSpec  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

LOSSES = ("cross_entropy", "importance_sampling")
LENGTHS = (4096, 3001, 1027, 5)  # one long sequence per micro-batch, then ragged ones
BUDGET = 4096  # max_tokens_per_microbatch: several micro-batches (a CP rank: per GPU, cp × this)


def run_sequence(engine) -> dict:
    """The calls both CP sizes make: both losses with backward, one AdamW step, forward_only."""
    out: dict = {"before": {k: v.float().cpu() for k, v in engine.hf_weights().items()}}
    for loss in LOSSES:
        result = engine.forward_backward(batch(1, loss, LENGTHS), loss, None, forward_only=False)
        out[loss] = result
    out["step"] = engine.optim_step(ADAM)
    out["after"] = {k: v.float().cpu() for k, v in engine.hf_weights().items()}
    out["forward_only"] = engine.forward_backward(
        batch(2, "cross_entropy", LENGTHS), "cross_entropy", None, forward_only=True
    )
    return out


def reference_cp1(path: Path, out: Path) -> None:
    """CP = 1 in this (sub)process; results → `out` (torch.save)."""
    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronTrainerEngine

    engine = MegatronTrainerEngine(
        path, LoraSpec(0), dtype="bfloat16", device="cuda", max_tokens_per_microbatch=BUDGET
    )
    result = run_sequence(engine)
    result["before"] = {k: v.bfloat16() for k, v in result["before"].items()}  # exact: bf16 params
    result["after"] = {k: v.bfloat16() for k, v in result["after"].items()}
    torch.save(result, out)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def cp1(model, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("cp1") / "cp1.pt"
    done = subprocess.run(
        [sys.executable, __file__, str(model), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def cp2(model, cp1):  # cp1 first: its process has left the GPU before the group starts
    import ray

    from oneloop.backends.megatron_local.engines.megatron.group import MegatronRayGroup
    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronParallel

    if not ray.is_initialized():  # the group's ranks are Ray actors, one GPU each
        ray.init(address="local", num_gpus=2, include_dashboard=False)
    engine = MegatronRayGroup(
        model,
        LoraSpec(0),
        dtype="bfloat16",
        device="cuda",
        parallel=MegatronParallel(cp=2),
        max_tokens_per_microbatch=BUDGET,
    )
    yield engine
    engine.close()


def test_cp2_matches_cp1(cp1, cp2) -> None:
    got = run_sequence(cp2)
    figures: dict = {}
    for loss in (*LOSSES, "forward_only"):
        r2, r1 = got[loss], cp1[loss]
        gaps = logprob_gaps(r2, r1)
        assert [len(x) for x in r2.logprobs] == list(LENGTHS)
        figures[loss] = {
            "loss_cp2": r2.loss,
            "loss_cp1": r1.loss,
            "loss_abs_diff_per_token": abs(r2.loss - r1.loss) / sum(LENGTHS),
            "logprob_abs_diff_mean": float(gaps.mean()),
            "logprob_abs_diff_max": float(gaps.max()),
        }
        assert figures[loss]["loss_abs_diff_per_token"] < 0.01
        assert figures[loss]["logprob_abs_diff_mean"] < 0.02
    before = got["before"]
    after_2 = {k: v.float() for k, v in got["after"].items()}
    after_1 = {k: v.float() for k, v in cp1["after"].items()}
    diffs = torch.cat([(after_2[k] - after_1[k]).abs().flatten() for k in after_1])
    upd_2 = torch.cat([(after_2[k] - before[k]).flatten() for k in after_1])
    upd_1 = torch.cat([(after_1[k] - before[k]).flatten() for k in after_1])
    norm_2, norm_1 = got["step"]["grad_norm:mean"], cp1["step"]["grad_norm:mean"]
    figures["optim_step"] = {
        "grad_norm_cp2": norm_2,
        "grad_norm_cp1": norm_1,
        "weight_abs_diff_max": float(diffs.max()),
        "weight_abs_diff_mean": float(diffs.mean()),
        "update_cosine": float(
            torch.nn.functional.cosine_similarity(upd_2.double(), upd_1.double(), dim=0)
        ),
    }
    record("megatron_cp", figures)
    # a sum, not an average, over the CP ranks: an averaged gradient would halve the norm
    assert abs(norm_2 - norm_1) / norm_1 < 0.05
    assert figures["optim_step"]["update_cosine"] > 0.9
    assert figures["optim_step"]["weight_abs_diff_mean"] < ADAM["learning_rate"]


def test_save_and_load_state_restores_weights_and_optimizer(cp2, tmp_path) -> None:
    data = batch(2, "cross_entropy", LENGTHS)
    cp2.forward_backward(batch(3, "cross_entropy", LENGTHS), "cross_entropy", None, False)
    cp2.optim_step(ADAM)  # the checkpoint then carries Adam moments and fp32 main params per rank
    cp2.save_state(tmp_path / "ckpt", with_optimizer=True)
    assert (tmp_path / "ckpt" / "optimizer.tp1.cp2.rank1.pt").is_file()
    expected = cp2.forward_backward(data, "cross_entropy", None, forward_only=False)
    cp2.optim_step(ADAM)
    after_one = cp2.forward_backward(data, "cross_entropy", None, forward_only=True).loss
    cp2.load_state(tmp_path / "ckpt", with_optimizer=True)
    again = cp2.forward_backward(data, "cross_entropy", None, forward_only=False)
    assert again.loss == pytest.approx(expected.loss, rel=1e-6)
    cp2.optim_step(ADAM)
    assert cp2.forward_backward(data, "cross_entropy", None, forward_only=True).loss == (
        pytest.approx(after_one, rel=1e-4)
    )


if __name__ == "__main__":
    reference_cp1(Path(sys.argv[1]), Path(sys.argv[2]))
