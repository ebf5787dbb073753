"""The `megatron` trainer at TP = 2 (two GPUs, `megatron.group`) against TP = 1, same random Qwen3
(0.6 B shape, bf16): forward_backward loss and target logprobs, grad norm and HF weights after one
optim_step, save/load restore, the group inside a Ray trainer actor, and a dead worker rank turning
into an error.

TP = 1 runs first in a subprocess (torch.distributed is one world per process; this file run as a
script is that subprocess), then TP = 2 in the test process. Device only, nvidia-h200-x2:
`pytest -m gpu tests/gpu/test_megatron_tp.py` (gpu_run.sh stage `tp`). Figures →
$OUT/megatron_tp.json.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs (nvidia-h200-x2)", allow_module_level=True)

from gpu_figures import ADAM, batch, model_dir, record  # noqa: E402

from oneloop.backends.megatron_local.engines.base import LoraSpec  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

LOSSES = ("cross_entropy", "importance_sampling")


def run_sequence(engine) -> dict:
    """The calls both TP sizes make: both losses with backward, then one AdamW step."""
    out: dict = {"before": {k: v.float().cpu() for k, v in engine.hf_weights().items()}}
    for loss in LOSSES:
        result = engine.forward_backward(batch(1, loss), loss, None, forward_only=False)
        out[loss] = (result.loss, result.logprobs)
    out["step"] = engine.optim_step(ADAM)
    out["after"] = {k: v.float().cpu() for k, v in engine.hf_weights().items()}
    return out


def reference_tp1(path: Path, out: Path) -> None:
    """TP = 1 in this (sub)process; results → `out` (torch.save)."""
    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronTrainerEngine

    engine = MegatronTrainerEngine(path, LoraSpec(0), dtype="bfloat16", device="cuda")
    result = run_sequence(engine)
    result["before"] = {k: v.bfloat16() for k, v in result["before"].items()}  # exact: bf16 params
    result["after"] = {k: v.bfloat16() for k, v in result["after"].items()}
    torch.save(result, out)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def tp1(model, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tp1") / "tp1.pt"
    done = subprocess.run(
        [sys.executable, __file__, str(model), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def tp2(model, tp1):  # tp1 first: its process has left the GPU before the group starts
    import ray

    from oneloop.backends.megatron_local.engines.megatron.group import MegatronRayGroup
    from oneloop.backends.megatron_local.engines.megatron.trainer import MegatronParallel

    if not ray.is_initialized():  # the group's ranks are Ray actors, one GPU each
        ray.init(address="local", num_gpus=2, include_dashboard=False)
    engine = MegatronRayGroup(
        model, LoraSpec(0), dtype="bfloat16", device="cuda", parallel=MegatronParallel(tp=2)
    )
    yield engine
    engine.close()


def test_tp2_matches_tp1(tp1, tp2) -> None:
    got = run_sequence(tp2)
    figures: dict = {}
    assert sorted(got["before"]) == sorted(tp1["before"])
    import_gap = max(
        float((got["before"][k] - tp1["before"][k].float()).abs().max()) for k in got["before"]
    )
    figures["import_export_abs_diff_max"] = import_gap
    assert import_gap == 0.0  # shard on import, gather on export: exact
    for loss in LOSSES:
        (loss_2, lp_2), (loss_1, lp_1) = got[loss], tp1[loss]
        gaps = np.concatenate([np.abs(a - b) for a, b in zip(lp_2, lp_1, strict=True)])
        tokens = sum(len(x) for x in lp_1)
        figures[loss] = {
            "loss_tp2": loss_2,
            "loss_tp1": loss_1,
            "loss_abs_diff_per_token": abs(loss_2 - loss_1) / tokens,
            "logprob_abs_diff_mean": float(gaps.mean()),
            "logprob_abs_diff_max": float(gaps.max()),
        }
        assert figures[loss]["loss_abs_diff_per_token"] < 0.01
        assert figures[loss]["logprob_abs_diff_mean"] < 0.02
    before = got["before"]
    after_2 = {k: v.float() for k, v in got["after"].items()}
    after_1 = {k: v.float() for k, v in tp1["after"].items()}
    diffs = torch.cat([(after_2[k] - after_1[k]).abs().flatten() for k in after_1])
    upd_2 = torch.cat([(after_2[k] - before[k]).flatten() for k in after_1])
    upd_1 = torch.cat([(after_1[k] - before[k]).flatten() for k in after_1])
    norm_2, norm_1 = got["step"]["grad_norm:mean"], tp1["step"]["grad_norm:mean"]
    figures["optim_step"] = {
        "grad_norm_tp2": norm_2,
        "grad_norm_tp1": norm_1,
        "weight_abs_diff_max": float(diffs.max()),
        "weight_abs_diff_mean": float(diffs.mean()),
        # in float64: a bf16 reduction over 0.6 B elements gave a "cosine" of 4.1 on the device
        "update_cosine": float(
            torch.nn.functional.cosine_similarity(upd_2.double(), upd_1.double(), dim=0)
        ),
    }
    record("megatron_tp", figures)
    assert abs(norm_2 - norm_1) / norm_1 < 0.05  # TP-sharded params counted once, QK-norm summed
    assert figures["optim_step"]["update_cosine"] > 0.9
    assert figures["optim_step"]["weight_abs_diff_mean"] < ADAM["learning_rate"]


def test_save_and_load_state_restores_weights_and_optimizer(tp2, tmp_path) -> None:
    data = batch(2, "cross_entropy")
    tp2.forward_backward(batch(3, "cross_entropy"), "cross_entropy", None, forward_only=False)
    tp2.optim_step(ADAM)  # the checkpoint then carries Adam moments and fp32 main params per rank
    tp2.save_state(tmp_path / "ckpt", with_optimizer=True)
    assert (tmp_path / "ckpt" / "optimizer.tp2.rank1.pt").is_file()
    expected = tp2.forward_backward(data, "cross_entropy", None, forward_only=False)
    tp2.optim_step(ADAM)
    after_one = tp2.forward_backward(data, "cross_entropy", None, forward_only=True).loss
    tp2.load_state(tmp_path / "ckpt", with_optimizer=True)
    again = tp2.forward_backward(data, "cross_entropy", None, forward_only=False)
    assert again.loss == pytest.approx(expected.loss, rel=1e-6)
    tp2.optim_step(ADAM)
    assert tp2.forward_backward(data, "cross_entropy", None, forward_only=True).loss == (
        pytest.approx(after_one, rel=1e-4)
    )


def test_dead_worker_is_a_clear_error(tp2) -> None:  # last: it breaks the group
    import ray

    ray.kill(tp2._actors[1])  # rank 1's actor dies; the next call names it and its node
    with pytest.raises(RuntimeError, match=r"rank 1 \(.*\) on node .* died"):
        tp2.forward_backward(batch(4, "cross_entropy"), "cross_entropy", None, forward_only=True)
    with pytest.raises(RuntimeError, match="broken"):
        tp2.optim_step(ADAM)



def test_ray_trainer_actor_hosts_the_tp_group(model, tp1) -> None:
    """The trainer actor holds the group engine like any engine: it holds no GPU itself
    (`factory.trainer_actor_gpus`) and starts both ranks as Ray actors, one GPU each. Runs after
    the dead-rank test, whose broken group has freed its GPUs."""
    ray = pytest.importorskip("ray")
    from oneloop.backends.config import LocalBackendConfig
    from oneloop.backends.megatron_local.actors import TrainerActor

    local = LocalBackendConfig(
        trainer_engine="megatron", dtype="bfloat16", gpus_per_trainer=2, megatron={"tp": 2}
    )
    from oneloop.backends.megatron_local.engines.factory import trainer_actor_gpus

    if not ray.is_initialized():
        ray.init(address="local", num_gpus=2, include_dashboard=False)
    try:
        gpus = trainer_actor_gpus(local)
        assert gpus == 0.0
        actor = TrainerActor.options(num_gpus=gpus).remote(local, str(model), LoraSpec(0))
        assert ray.get(actor.ready.remote(), timeout=600)
        data = batch(1, "cross_entropy")
        result = ray.get(
            actor.forward_backward.remote(data, "cross_entropy", None, False), timeout=300
        )
        tokens = sum(len(d.tokens) for d in data)
        figures = {"loss_actor_tp2": result.loss, "loss_tp1": tp1["cross_entropy"][0]}
        record("megatron_tp_actor", figures)
        assert abs(result.loss - tp1["cross_entropy"][0]) / tokens < 0.01
        ray.kill(actor)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    reference_tp1(Path(sys.argv[1]), Path(sys.argv[2]))
