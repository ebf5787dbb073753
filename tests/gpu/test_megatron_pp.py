"""The `megatron` trainer at PP = 2 (two GPUs, `megatron.group` + `parallel.pp`) against PP = 1,
same random Qwen3 (0.6 B shape, 28 layers, tied embeddings, bf16): forward_backward loss and
target logprobs over several token-budget micro-batches of different shapes, grad norm and HF
weights after one optim_step (update cosine in float64), save/load restore with per-rank optimizer
shards, forward_only, a size mismatch refused, and a dead worker rank turning into an error.

PP = 1 runs first in a subprocess (torch.distributed is one world per process; this file run as a
script is that subprocess), then PP = 2 in the test process. Device only, nvidia-h200-x2:
`pytest -m gpu tests/gpu/test_megatron_pp.py` (gpu_run.sh stage `pp`). Figures →
$OUT/megatron_pp.json.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs (nvidia-h200-x2)", allow_module_level=True)

from gpu_figures import ADAM, batch, logprob_gaps, model_dir, record  # noqa: E402

from oneloop.backends.megatron_local.engines.base import LoraSpec  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

LOSSES = ("cross_entropy", "importance_sampling")
BUDGET = 1024  # the ragged batch → 4 micro-batches of shapes [2,512], [3,300], [2,512], [2,450]


def run_sequence(engine) -> dict:
    """The calls both PP sizes make: both losses with backward, one AdamW step, forward_only."""
    out: dict = {"before": {k: v.float().cpu() for k, v in engine.hf_weights().items()}}
    for loss in LOSSES:
        result = engine.forward_backward(batch(1, loss), loss, None, forward_only=False)
        out[loss] = (result.loss, result.logprobs, result.per_datum_loss)
    out["step"] = engine.optim_step(ADAM)
    out["after"] = {k: v.float().cpu() for k, v in engine.hf_weights().items()}
    after = engine.forward_backward(batch(5, "cross_entropy"), "cross_entropy", None, True)
    out["forward_only"] = (after.loss, after.logprobs)
    return out


def reference_pp1(path: Path, out: Path) -> None:
    """PP = 1 in this (sub)process; results → `out` (torch.save)."""
    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronTrainerEngine

    engine = MegatronTrainerEngine(
        path, LoraSpec(0), dtype="bfloat16", device="cuda", max_tokens_per_microbatch=BUDGET
    )
    result = run_sequence(engine)
    result["before"] = {k: v.bfloat16() for k, v in result["before"].items()}  # exact: bf16 params
    result["after"] = {k: v.bfloat16() for k, v in result["after"].items()}
    torch.save(result, out)


class _Result:  # ForwardResult's logprobs only, for gpu_figures.logprob_gaps
    def __init__(self, logprobs) -> None:
        self.logprobs = logprobs


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def pp1(model, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("pp1") / "pp1.pt"
    done = subprocess.run(
        [sys.executable, __file__, str(model), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def pp2(model, pp1):  # pp1 first: its process has left the GPU before the group starts
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
        parallel=MegatronParallel(pp=2),
        max_tokens_per_microbatch=BUDGET,
    )
    yield engine
    engine.close()


def test_pp2_matches_pp1(pp1, pp2) -> None:
    got = run_sequence(pp2)
    figures: dict = {}
    assert sorted(got["before"]) == sorted(pp1["before"])
    import_gap = max(
        float((got["before"][k] - pp1["before"][k].float()).abs().max()) for k in got["before"]
    )
    figures["import_export_abs_diff_max"] = import_gap
    assert import_gap == 0.0  # stage split on import, stages gathered on export: exact
    for loss in LOSSES:
        (loss_2, lp_2, per_2), (loss_1, lp_1, per_1) = got[loss], pp1[loss]
        assert [len(x) for x in lp_2] == [len(x) for x in lp_1]  # every datum, input order
        gaps = logprob_gaps(_Result(lp_2), _Result(lp_1))
        tokens = sum(len(x) for x in lp_1)
        figures[loss] = {
            "loss_pp2": loss_2,
            "loss_pp1": loss_1,
            "loss_abs_diff_per_token": abs(loss_2 - loss_1) / tokens,
            "per_datum_loss_abs_diff_max": float(np.abs(np.array(per_2) - per_1).max()),
            "logprob_abs_diff_mean": float(gaps.mean()),
            "logprob_abs_diff_max": float(gaps.max()),
        }
        assert figures[loss]["loss_abs_diff_per_token"] < 0.01
        assert figures[loss]["logprob_abs_diff_mean"] < 0.02
    before = got["before"]
    after_2 = {k: v.float() for k, v in got["after"].items()}
    after_1 = {k: v.float() for k, v in pp1["after"].items()}
    diffs = torch.cat([(after_2[k] - after_1[k]).abs().flatten() for k in after_1])
    upd_2 = torch.cat([(after_2[k] - before[k]).flatten() for k in after_1])
    upd_1 = torch.cat([(after_1[k] - before[k]).flatten() for k in after_1])
    norm_2, norm_1 = got["step"]["grad_norm:mean"], pp1["step"]["grad_norm:mean"]
    fo_gaps = logprob_gaps(_Result(got["forward_only"][1]), _Result(pp1["forward_only"][1]))
    figures["optim_step"] = {
        "grad_norm_pp2": norm_2,
        "grad_norm_pp1": norm_1,
        "weight_abs_diff_max": float(diffs.max()),
        "weight_abs_diff_mean": float(diffs.mean()),
        # float64: a bf16 reduction over 0.6 B elements is no cosine
        "update_cosine": float(
            torch.nn.functional.cosine_similarity(upd_2.double(), upd_1.double(), dim=0)
        ),
        "tied_embedding_equals_lm_head": bool(
            torch.equal(after_2["model.embed_tokens.weight"], after_2["lm_head.weight"])
        ),
        "forward_only_after_step_logprob_abs_diff_mean": float(fo_gaps.mean()),
        "forward_only_after_step_logprob_abs_diff_max": float(fo_gaps.max()),
    }
    record("megatron_pp", figures)
    assert abs(norm_2 - norm_1) / norm_1 < 0.05  # every stage counted, the tied copy once
    assert figures["optim_step"]["update_cosine"] > 0.9
    assert figures["optim_step"]["weight_abs_diff_mean"] < ADAM["learning_rate"]
    assert figures["optim_step"]["forward_only_after_step_logprob_abs_diff_mean"] < 0.02


def test_save_and_load_state_restores_weights_and_optimizer(pp2, tmp_path) -> None:
    data = batch(2, "cross_entropy")
    pp2.forward_backward(batch(3, "cross_entropy"), "cross_entropy", None, forward_only=False)
    pp2.optim_step(ADAM)  # the checkpoint then carries Adam moments and fp32 main params per rank
    ckpt = tmp_path / "ckpt"
    pp2.save_state(ckpt, with_optimizer=True)
    assert (ckpt / "optimizer.tp1.pp2.rank1.pt").is_file()
    assert json.loads((ckpt / "engine.json").read_text())["pp"] == 2
    expected = pp2.forward_backward(data, "cross_entropy", None, forward_only=False)
    pp2.optim_step(ADAM)
    after_one = pp2.forward_backward(data, "cross_entropy", None, forward_only=True).loss
    pp2.load_state(ckpt, with_optimizer=True)
    again = pp2.forward_backward(data, "cross_entropy", None, forward_only=False)
    assert again.loss == pytest.approx(expected.loss, rel=1e-6)
    pp2.optim_step(ADAM)
    assert pp2.forward_backward(data, "cross_entropy", None, forward_only=True).loss == (
        pytest.approx(after_one, rel=1e-4)
    )
    state = json.loads((ckpt / "engine.json").read_text())
    (ckpt / "engine.json").write_text(json.dumps({**state, "pp": 4}))
    with pytest.raises(ValueError, match="pp=4"):  # every rank refuses alike: group usable
        pp2.load_state(ckpt, with_optimizer=True)
    pp2.forward_backward(data, "cross_entropy", None, forward_only=True)


def test_dead_worker_is_a_clear_error(pp2) -> None:  # last: it breaks the group
    import ray

    ray.kill(pp2._actors[1])  # rank 1's actor dies; the next call names it and its node
    with pytest.raises(RuntimeError, match=r"rank 1 \(.*\) on node .* died"):
        pp2.forward_backward(batch(4, "cross_entropy"), "cross_entropy", None, forward_only=True)
    with pytest.raises(RuntimeError, match="broken"):
        pp2.optim_step(ADAM)


if __name__ == "__main__":
    reference_pp1(Path(sys.argv[1]), Path(sys.argv[2]))
