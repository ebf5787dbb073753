"""`oneloop size` against figures computed by hand from published model configs.

Every expected number below is written out from the config values (the fixtures in
tests/fixtures/model_configs were written from the published Qwen3 / Qwen3-Next configs), never
by calling the code under test.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from oneloop.diagnostics import size

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "model_configs"
ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30


def run_json(capsys, config: Path | str, *extra: str, **knobs: object) -> dict:
    args = {
        "gpu-memory-gib": 80,
        "engines": 4,
        "mean-trajectory-tokens": 20000,
        "max-staleness": 3,
        "groups-per-step": 16,
        "samples-per-group": 16,
        **{k.replace("_", "-"): v for k, v in knobs.items()},
    }
    argv = [str(config), "--json", *extra]
    for key, value in args.items():
        argv += [f"--{key}", str(value)]
    assert size.main(argv) == 0
    return json.loads(capsys.readouterr().out)


def run_error(capsys, argv: list[str]) -> str:
    assert size.main(argv) == 2
    return capsys.readouterr().err


QWEN3_8B_PARAMS = (
    2 * 151936 * 4096  # embeddings + untied LM head
    + 36 * (
        4096 * 32 * 128 + 2 * 4096 * 8 * 128 + 32 * 128 * 4096 + 2 * 128  # q,k,v,o + q/k norms
        + 3 * 4096 * 12288  # gate, up, down
        + 2 * 4096  # two RMSNorms
    )
    + 4096  # final norm
)  # fmt: skip


def test_qwen3_8b_dense_figures(capsys) -> None:
    r = run_json(capsys, FIXTURES / "qwen3-8b.json", lora_rank=32, trainer_gpus=8)
    assert r["kv_bytes_per_token"] == 2 * 36 * 8 * 128 * 2 == 147_456
    assert r["params"]["total"] == QWEN3_8B_PARAMS == 8_190_735_360  # "8.2B" on the model card
    assert r["weight_bytes"] == 2 * 8_190_735_360
    budget = 80 * GIB * 9 // 10 - 2 * 8_190_735_360  # 80 GiB * 0.9 - weights / TP 1
    assert r["kv_budget_bytes_per_gpu"] == budget == 60_927_940_608
    assert r["kv_tokens_per_engine"] == budget // 147_456 == 413_194
    assert r["system_cap"] == 4 * (413_194 // 20_000) == 80
    assert r["staleness_cap"] == (3 + 1) * 16 * 16 == 1024
    assert r["recommended_max_concurrency"] == 80 and r["bound"] == "KV cache"
    # Full fine-tuning: 2 (bf16 weights) + 2 (bf16 grads) + 4 (fp32 master) + 4 (m) + 4 (v).
    assert r["trainer_bytes_per_param_full"] == 16
    assert r["trainer_full_bytes"] == 16 * 8_190_735_360
    lora = 36 * 32 * (
        (4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096)  # q, k, v, o
        + 3 * (4096 + 12288)  # gate, up, down
    )  # fmt: skip
    assert r["lora_params"] == lora == 87_293_952
    assert r["trainer_lora_bytes"] == 2 * 8_190_735_360 + 16 * lora
    assert r["notes"] == []


QWEN3_30B_A3B_PARAMS = (
    2 * 151936 * 2048
    + 48 * (
        2048 * 32 * 128 + 2 * 2048 * 4 * 128 + 32 * 128 * 2048 + 2 * 128
        + 128 * 3 * 2048 * 768  # 128 experts
        + 2048 * 128  # router
        + 2 * 2048
    )
    + 2048
)  # fmt: skip


def test_qwen3_30b_a3b_moe_figures_with_tp_and_fp8_kv(capsys) -> None:
    r = run_json(capsys, FIXTURES / "qwen3-30b-a3b.json", tp=2)
    assert r["kv_bytes_per_token"] == 2 * 48 * 4 * 128 * 2 == 98_304
    assert r["kv_bytes_per_token_per_gpu"] == 2 * 48 * 2 * 128 * 2  # 4 KV heads over TP 2
    assert r["params"]["total"] == QWEN3_30B_A3B_PARAMS == 30_532_122_624  # "30.5B"
    budget = 80 * GIB * 9 // 10 - 2 * 30_532_122_624 // 2
    assert r["kv_budget_bytes_per_gpu"] == budget
    tokens = budget // (2 * 48 * 2 * 128 * 2)
    assert r["kv_tokens_per_engine"] == tokens == 951_686
    assert r["system_cap"] == 4 * (tokens // 20_000) == 188
    assert r["recommended_max_concurrency"] == 188
    lora = 48 * 32 * (
        (2048 + 4096) + 2 * (2048 + 512) + (4096 + 2048)
        + 128 * 3 * (2048 + 768)  # every expert has its own adapter
    )  # fmt: skip
    assert r["lora_params"] == lora

    # TP 8 > 4 KV heads: vLLM replicates, one KV head per GPU; fp8 KV halves the bytes.
    r = run_json(capsys, FIXTURES / "qwen3-30b-a3b.json", tp=8, kv_dtype="fp8")
    assert r["kv_bytes_per_token"] == 2 * 48 * 4 * 128 * 1
    assert r["kv_bytes_per_token_per_gpu"] == 2 * 48 * 1 * 128 * 1 == 12_288
    tokens = (80 * GIB * 9 // 10 - 2 * 30_532_122_624 // 8) // 12_288
    assert r["kv_tokens_per_engine"] == tokens
    assert r["system_cap"] == 4 * (tokens // 20_000) == 1132
    assert r["recommended_max_concurrency"] == 1024 and r["bound"] == "staleness"


def test_hybrid_linear_attention_counts_only_full_attention_layers(capsys) -> None:
    r = run_json(capsys, FIXTURES / "qwen3-next-80b-a3b.json", tp=4, gpu_memory_gib=141)
    # full_attention_interval 4: layers 3, 7, ..., 47 are full attention (12 of 48).
    assert r["model"]["full_attention_layers"] == 12
    assert r["kv_bytes_per_token"] == 2 * 12 * 2 * 256 * 2 == 24_576
    assert any("36 linear-attention layers are not counted" in n for n in r["notes"])
    assert 79.0e9 < r["params"]["total"] < 81.0e9  # an "80B" model


def test_sliding_window_layers_and_head_dim_default(tmp_path: Path, capsys) -> None:
    """A Llama-2-7B-shaped config: no head_dim (= 4096 / 32), no num_key_value_heads (MHA)."""
    config = {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "intermediate_size": 11008,
        "vocab_size": 32000,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    r = run_json(capsys, tmp_path)  # a directory holding config.json
    assert r["kv_bytes_per_token"] == 2 * 32 * 32 * 128 * 2 == 524_288  # 0.5 MiB / token
    assert any("head_dim absent" in n for n in r["notes"])
    assert any("num_key_value_heads absent" in n for n in r["notes"])

    config["layer_types"] = ["sliding_attention", "full_attention"] * 16
    config["sliding_window"] = 4096
    (tmp_path / "config.json").write_text(json.dumps(config))
    r = run_json(capsys, tmp_path)
    assert r["kv_bytes_per_token"] == 2 * 16 * 32 * 128 * 2
    assert any("16 sliding-window layers are not counted" in n for n in r["notes"])


def test_staleness_cap_matches_the_seed_figures_and_presets(capsys) -> None:
    """DESIGN.md's seed: staleness 3, 16 prompts x 16 samples, concurrency 300-550. The
    staleness cap (3+1)*16*16 = 1024 sits above 550, so the seed's concurrency was bound by the
    KV cache; every preset carrying the seed's knobs stays within the staleness cap."""
    r = run_json(capsys, FIXTURES / "qwen3-8b.json")
    assert r["staleness_cap"] == 1024 > 550
    for preset in sorted((ROOT / "oneloop" / "loop" / "presets").glob("qwen*.yaml")):
        cfg = yaml.safe_load(preset.read_text())
        algo = cfg["algo"]
        r = run_json(
            capsys,
            FIXTURES / "qwen3-8b.json",
            max_staleness=algo["max_staleness"],
            groups_per_step=algo["groups_per_step"],
            samples_per_group=algo["group_size"],
        )
        assert (algo["max_staleness"], algo["groups_per_step"], algo["group_size"]) == (3, 16, 16)
        assert cfg["rollout"]["max_concurrency"] <= 550 <= r["staleness_cap"], preset.name
        # The seed's concurrency floor holds where the preset has the seed's sampling fleet;
        # qwen3-30b-a3b's one sampling node (4 engines of TP 2) holds 268 32k-token trajectories
        # of KV cache, so `oneloop size` sized it at 256, and qwen3-8b-1node's four one-GPU
        # engines (half of one node) hold 100 (their headers).
        floor = {"qwen3-30b-a3b.yaml": 256, "qwen3-8b-1node.yaml": 100}.get(preset.name, 300)
        assert cfg["rollout"]["max_concurrency"] >= floor, preset.name


def test_weights_that_do_not_fit_give_zero_and_say_so(capsys) -> None:
    r = run_json(capsys, FIXTURES / "qwen3-30b-a3b.json", gpu_memory_gib=40)
    assert not r["fits"]
    assert r["system_cap"] == 0 and r["recommended_max_concurrency"] == 0
    assert any("weights do not fit" in n for n in r["notes"])


BASE = ["--gpu-memory-gib", "80", "--engines", "4", "--mean-trajectory-tokens", "20000",
        "--max-staleness", "3", "--groups-per-step", "16", "--samples-per-group", "16"]  # fmt: skip


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (["--engines", "0"], "--engines: must be >= 1"),
        (["--gpu-memory-gib", "-80"], "--gpu-memory-gib: must be > 0"),
        (["--mean-trajectory-tokens", "1.5"], "--mean-trajectory-tokens: expected an integer"),
        (["--samples-per-group", "lots"], "--samples-per-group: expected a number"),
        (["--gpu-utilization", "1.5"], "--gpu-utilization: must be <= 1"),
        (["--gpu-utilization", "0"], "--gpu-utilization: must be > 0"),
        (["--max-staleness", "-1"], "--max-staleness: must be >= 0"),
        (["--tp", "3"], "--tp: 3 does not divide num_attention_heads=32"),
        (["--kv-dtype", "int3"], "--kv-dtype: unknown dtype 'int3'"),
    ],
)
def test_bad_numbers_name_the_field(capsys, override: list[str], expected: str) -> None:
    argv = [str(FIXTURES / "qwen3-8b.json"), *BASE, *override]
    assert expected in run_error(capsys, argv)


def test_bad_configs_name_the_file_and_key(tmp_path: Path, capsys) -> None:
    assert "not a config.json file" in run_error(capsys, [str(tmp_path / "nope.json"), *BASE])
    config = json.loads((FIXTURES / "qwen3-8b.json").read_text())
    del config["num_hidden_layers"]
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps(config))
    assert "missing required key 'num_hidden_layers'" in run_error(capsys, [str(bad), *BASE])
    config["num_hidden_layers"] = 0
    bad.write_text(json.dumps(config))
    assert "'num_hidden_layers' must be an integer >= 1" in run_error(capsys, [str(bad), *BASE])
    bad.write_text("{not json")
    assert "is not valid JSON" in run_error(capsys, [str(bad), *BASE])
    # A required flag missing is a usage error, exit 2, from argparse.
    assert size.main([str(FIXTURES / "qwen3-8b.json")]) == 2
    assert "--gpu-memory-gib" in capsys.readouterr().err


def test_cli_subprocess_text_shows_the_arithmetic() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "oneloop.cli", "size", str(FIXTURES / "qwen3-8b.json"), *BASE],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "KV bytes/token = 2 (K,V) * 36 full-attention layers * 8 KV heads * 128" in out
    assert "= 147,456 B" in out
    assert "staleness cap = (S+1)*B*n = (3+1)*16*16 = 1,024" in out
    assert "recommended max_concurrency: 80" in out
    assert "full fine-tuning B/param = 2 (weights bfloat16) + 2 (grads bf16)" in out
    done = subprocess.run(
        [sys.executable, "-m", "oneloop.cli", "size", "/nonexistent/config.json", *BASE],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "config: '/nonexistent/config.json' is not a config.json file" in done.stderr


def test_the_35b_preset_layout_fits_its_trainer_gpus(capsys) -> None:
    """Qwen3.6-35B-A3B (config: transformers' Qwen3_5MoeConfig defaults, the card's width) at the
    qwen3.6-35b-a3b preset's layout, ep 8 over 8 GPUs: 256 experts whole, 32 a GPU, their
    optimizer state unsharded (expert dp = 1); 72.5 GiB of state on the busiest H200."""
    config = FIXTURES / "qwen3.6-35b-a3b-text.json"
    report = run_json(capsys, config, "--trainer-layout", "ep=8", trainer_gpus=8, tp=2)
    layout = report["trainer_layout"]
    assert layout["layout"] == {"tp": 1, "pp": 1, "cp": 1, "ep": 8, "dp": 8, "expert_dp": 1}
    routed = 40 * 256 * 3 * 2048 * 512
    dense = report["params"]["total"] - routed
    expected = dense * (2 + 2 + 12 / 8) + routed / 8 * (2 + 2 + 12)
    assert abs(layout["bytes_per_gpu"] - expected) <= 1
    assert 72 * 2**30 < layout["bytes_per_gpu"] < 73 * 2**30 < 141 * 2**30


def test_trainer_layout_splits_experts_and_their_optimizer_as_megatron_does(capsys) -> None:
    """The 397B hybrid (config from the published card: 60 layers, 512 experts of width 1024,
    hidden 4096, vocab 248,320, untied) at the preset's pp 10 × dp 8, ep 8 on 80 GPUs: the routed
    experts split 80 ways with their optimizer state unsharded (expert dp = 1); the dense
    parameters split by stage (the end stage holding one embedding matrix), their optimizer state
    sharded over the 8 replicas."""
    config = FIXTURES / "qwen3.5-397b-a17b-text.json"
    report = run_json(capsys, config, "--trainer-layout", "pp=10,ep=8", trainer_gpus=80, tp=8)
    routed = 60 * 512 * 3 * 4096 * 1024
    body = (  # every parameter but the embeddings and the routed experts
        15 * (4096 * 32 * 256 * 2 + 2 * 4096 * 2 * 256 + 32 * 256 * 4096 + 2 * 256)  # gated attn
        + 45 * (  # Gated DeltaNet: in_proj qkvz and ba, out_proj, conv, A_log, dt_bias, norm
            4096 * (2 * 16 * 128 + 2 * 64 * 128) + 4096 * 2 * 64 + 64 * 128 * 4096
            + (2 * 16 * 128 + 64 * 128) * 4 + 64 + 64 + 128
        )
        + 60 * (4096 * 512 + 3 * 4096 * 1024 + 4096)  # router, shared expert and its gate
        + 2 * 4096 * 60 + 4096  # norms
    )  # fmt: skip
    assert body == 7_765_056_256
    dense = body / 10 + 248320 * 4096
    expected = dense * (2 + 2) + dense * 12 / 8 + routed / 80 * (2 + 2 + 12)
    layout = report["trainer_layout"]
    assert layout["layout"] == {"tp": 1, "pp": 10, "cp": 1, "ep": 8, "dp": 8, "expert_dp": 1}
    assert abs(layout["bytes_per_gpu"] - expected) <= 1
    # the even-sharding figure understates it: experts' optimizer state is not sharded at ep = dp
    assert layout["bytes_per_gpu"] > report["trainer_full_bytes"] / 80
    args = [str(config), *BASE, "--trainer-gpus", "80", "--trainer-layout"]
    assert "tp·pp·cp = 12 does not divide --trainer-gpus=80" in run_error(capsys, [*args, "pp=12"])
    assert "ep=16 must divide the 512 experts and tp·dp·cp = 8" in run_error(
        capsys, [*args, "pp=10,ep=16"]
    )
    # tp 2: the dense parameters split over the TP pair; each expert stays whole (the megatron
    # engine's expert TP 1), ep 8 carved out of a stage's tp · dp = 8 ranks
    tp2 = run_json(capsys, config, "--trainer-layout", "tp=2,pp=10,ep=8", trainer_gpus=80, tp=8)
    half = dense / 2
    expected = half * (2 + 2) + half * 12 / 4 + routed / 80 * (2 + 2 + 12)
    layout = tp2["trainer_layout"]
    assert layout["layout"] == {"tp": 2, "pp": 10, "cp": 1, "ep": 8, "dp": 4, "expert_dp": 1}
    assert abs(layout["bytes_per_gpu"] - expected) <= 1
    seven = [str(config), *BASE, "--trainer-gpus", "84", "--trainer-layout", "pp=7"]
    assert "pp=7 does not divide the 60 layers" in run_error(capsys, seven)
    assert "'xp=2' is not one of tp=N" in run_error(capsys, [*args, "xp=2"])
