"""The megatron engines' checkpoint layout, shared by the one-process engine and every group rank
class (TP, PP, CP, LoRA-TP): optimizer file names per rank, and a checkpoint whose optimizer state
was written at other parallel sizes refused before anything is loaded. Checked without
megatron-core (the engines themselves: tests/backends/engines/megatron_cpu/, tests/gpu/)."""

import json

import pytest

from oneloop.backends.megatron_local.engines.megatron.trainer import (
    MegatronParallel,
    MegatronTrainerEngine,
    optimizer_file,
)


@pytest.mark.parametrize(
    ("layout", "rank", "name"),
    [
        ({"tp": 1, "pp": 1, "cp": 1}, 0, "optimizer.pt"),
        ({"tp": 2, "pp": 1, "cp": 1}, 1, "optimizer.tp2.rank1.pt"),
        ({"tp": 1, "pp": 2, "cp": 1}, 1, "optimizer.tp1.pp2.rank1.pt"),
        ({"tp": 2, "pp": 1, "cp": 2}, 3, "optimizer.tp2.cp2.rank3.pt"),
    ],
)
def test_each_rank_has_its_own_optimizer_file(layout, rank, name):
    assert optimizer_file(layout, rank) == name


def _engine(te: bool = False, **sizes) -> MegatronTrainerEngine:
    engine = object.__new__(MegatronTrainerEngine)  # no model: the refusal comes first
    engine.parallel = MegatronParallel(**sizes)
    engine.te = te
    return engine


@pytest.mark.parametrize(
    ("saved", "runs", "message"),
    [
        ({"tp": 2}, {}, "saved at local.megatron tp=2 pp=1 cp=1, this trainer runs tp=1 pp=1 cp=1"),
        ({}, {"tp": 2}, "saved at local.megatron tp=1 pp=1 cp=1, this trainer runs tp=2 pp=1"),
        ({"tp": 1, "pp": 2}, {"tp": 2, "pp": 2}, "tp=1 pp=2 cp=1, this trainer runs tp=2 pp=2"),
        ({"cp": 2}, {"pp": 2}, "tp=1 pp=1 cp=2, this trainer runs tp=1 pp=2 cp=1"),
    ],
)
def test_optimizer_state_of_other_sizes_is_refused_before_loading(tmp_path, saved, runs, message):
    (tmp_path / "engine.json").write_text(json.dumps({"steps": 3, **saved}))
    with pytest.raises(ValueError, match=message):
        _engine(**runs).load_state(tmp_path, with_optimizer=True)


@pytest.mark.parametrize(
    ("saved", "te", "message"),
    [
        ({"layer_spec": "te"}, False, "saved on the 'te' layer spec, this trainer builds 'local'"),
        (
            {"layer_spec": "local"},
            True,
            "saved on the 'local' layer spec, this trainer builds 'te'",
        ),
        ({}, True, "saved on the 'local' layer spec"),  # written before the TE spec was built
    ],
)
def test_optimizer_state_of_the_other_layer_spec_is_refused_before_loading(
    tmp_path, saved, te, message
):
    (tmp_path / "engine.json").write_text(json.dumps({"steps": 3, **saved}))
    with pytest.raises(ValueError, match=message) as error:
        _engine(te=te).load_state(tmp_path, with_optimizer=True)
    assert "load the weights only" in str(error.value)
