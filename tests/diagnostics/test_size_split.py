"""`oneloop size --nodes N`: the trainer/sampler split (`oneloop.diagnostics.split`), with the
figures written out by hand from the inputs (measured rates given, so the model's arithmetic is
plain), the FLOP model's active parameters of an MoE, and the refusal of a split without
samplers."""

import json
from pathlib import Path

import pytest

from oneloop.diagnostics import size

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs"
COMMON = ["--gpu-memory-gib", "141", "--mean-trajectory-tokens", "20000", "--max-staleness", "3",
          "--groups-per-step", "16", "--samples-per-group", "16"]  # fmt: skip


def split_of(capsys, config: str, *extra: str) -> dict:
    assert size.main([str(FIXTURES / config), "--json", *COMMON, *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_split_gives_rollouts_enough_that_the_trainer_never_waits(capsys):
    rates = ["--train-tokens-per-gpu-s", "3000", "--sample-tokens-per-gpu-s", "1000"]
    report = split_of(capsys, "qwen3-8b.json", "--trainer-gpus", "8", "--nodes", "4", *rates)
    split = report["split"]
    # 8 trainer GPUs x 3000 tok/s need 24 sampler GPUs at 1000 tok/s: 3 nodes of 8 + 1 trainer node.
    assert split["sampler_gpus_needed"] == 24 and split["nodes_needed"] == 4
    assert (split["trainer_nodes"], split["sampler_gpus"], split["engines"]) == (1, 24, 24)
    tokens = 16 * 16 * 20000
    assert split["step_train_s"] == pytest.approx(tokens / (8 * 3000))
    assert split["step_sample_s"] == pytest.approx(tokens / (24 * 1000))
    assert split["trainer_waits"] is False
    assert report["inputs"]["engines"] == 24  # --engines defaults to the split's engines
    short = split_of(capsys, "qwen3-8b.json", "--trainer-gpus", "8", "--nodes", "3", *rates)
    assert short["split"]["trainer_waits"] is True and short["split"]["engines"] == 16
    # 12 trainer GPUs: 2 nodes, the second's 4 free GPUs hold 2 engines of TP 2.
    odd = split_of(capsys, "qwen3-8b.json", "--trainer-gpus", "12", "--nodes", "3", "--tp", "2",
                   *rates)  # fmt: skip
    assert (odd["split"]["trainer_nodes"], odd["split"]["engines"]) == (2, 4 + 2)


def test_flop_model_counts_routed_experts_only(capsys):
    report = split_of(capsys, "qwen3-30b-a3b.json", "--trainer-gpus", "32", "--tp", "2",
                      "--nodes", "16")  # fmt: skip
    # Qwen3-30B-A3B: 48 MoE layers of 128 experts, 8 routed, 3 * 2048 * 768 each; untied input
    # embedding 151936 * 2048 is a lookup.
    inactive = 48 * (128 - 8) * 3 * 2048 * 768
    active = report["params"]["total"] - inactive - 151936 * 2048
    split = report["split"]
    assert split["active_params"] == active
    assert split["trainer_tokens_per_gpu_s"] == pytest.approx(989e12 * 0.35 / (6 * active))
    assert split["sampler_tokens_per_gpu_s"] == pytest.approx(989e12 * 0.04 / (2 * active))
    assert split["trainer_nodes"] == 4 and split["engines"] == 48


def test_split_refusals_name_the_flag(capsys):
    argv = [str(FIXTURES / "qwen3-8b.json"), *COMMON, "--trainer-gpus", "16", "--nodes", "2"]
    assert size.main(argv) == 2
    err = capsys.readouterr().err
    assert "--trainer-gpus 16: 2 nodes x 8 GPUs leave no GPU for sampling" in err
    assert size.main([str(FIXTURES / "qwen3-8b.json"), *COMMON]) == 2
    assert "--engines: required" in capsys.readouterr().err
