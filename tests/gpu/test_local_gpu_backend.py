"""The whole local backend on one GPU: Ray, a `megatron` trainer actor and a `vllm` sampler actor
(colocated, 0.5 GPU each, weights over CUDA IPC), driven through the Tinker client surface with
the SFT-then-RL call sequence of the parity test.

Checks: vLLM's sampled-token logprobs equal the trainer's target logprobs on the same tokens
(mean |Δ| ≤ 0.01, bf16) before and after an in-flight sync; requests in flight during the sync all
complete with every token. Device only; figures → $OUT/local_gpu_backend.json.
"""

import concurrent.futures
import time

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")
pytest.importorskip("ray")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gpu_figures import model_dir, record  # noqa: E402
from tinker import types  # noqa: E402

from oneloop.backends import connect  # noqa: E402
from oneloop.backends.config import (  # noqa: E402
    BackendConfig,
    LocalBackendConfig,
    VllmSettings,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1200)]
MODEL = "qwen3-0.6b-random"
GAP_TOLERANCE = 0.01
ADAM = types.AdamParams(learning_rate=1e-5, weight_decay=0.0, grad_clip_norm=1.0)


def sft_datum(rng: np.random.Generator, n: int) -> types.Datum:
    tokens = rng.integers(1000, 150000, n + 1).tolist()
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n},
    )


def logprob_gap(trainer, prompt: list[int], sequences) -> np.ndarray:
    """|sampler logprob − trainer target logprob| over every sampled token."""
    data = []
    for seq in sequences:
        full = prompt + list(seq.tokens)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)},
            )
        )
    out = trainer.forward(data, "cross_entropy").result()
    gaps = []
    for seq, lp in zip(sequences, out.loss_fn_outputs, strict=True):
        trainer_lp = lp["logprobs"].to_numpy()[len(prompt) - 1 :]
        gaps.append(np.abs(trainer_lp - np.asarray(seq.logprobs, np.float32)))
    return np.concatenate(gaps)


def test_sft_then_rl_through_ray_with_megatron_and_vllm(tmp_path_factory) -> None:
    path = model_dir(tmp_path_factory.mktemp("model"))
    config = BackendConfig(
        backend="local",
        run_dir=tmp_path_factory.mktemp("run"),
        models={MODEL: path},
        local=LocalBackendConfig(
            trainer_engine="megatron",
            sampler_engine="vllm",
            dtype="bfloat16",
            gpus_per_trainer=0.5,
            gpus_per_sampler=0.5,
            vllm=VllmSettings(gpu_memory_utilization=0.35, max_model_len=2048),
        ),
    )
    service = connect(config)
    trainer = service.create_lora_training_client(MODEL, rank=0).result()
    rng = np.random.default_rng(0)
    figures: dict = {"sft_loss": [], "rl_loss": []}

    # SFT warm start: forward_backward and optim_step submitted back to back.
    for _ in range(3):
        fwd = trainer.forward_backward([sft_datum(rng, 256) for _ in range(8)], "cross_entropy")
        opt = trainer.optim_step(ADAM)
        figures["sft_loss"].append(fwd.result().metrics["loss:sum"])
        opt.result()

    started = time.perf_counter()
    sampler = trainer.save_weights_and_get_sampling_client(kind="inflight").result()
    figures["first_sync_s"] = time.perf_counter() - started
    prompt = rng.integers(1000, 150000, 64).tolist()
    params = types.SamplingParams(max_tokens=64, temperature=1.0, seed=7)
    group = sampler.sample(types.ModelInput.from_ints(prompt), 8, params).result()
    gap = logprob_gap(trainer, prompt, group.sequences)
    figures["gap_after_sft"] = {"mean": float(gap.mean()), "max": float(gap.max())}
    record("local_gpu_backend", figures)  # recorded as it goes: a later failure keeps these

    # RL step on the sampled group (group-relative advantages of a made-up reward).
    rewards = np.array([len(set(s.tokens)) for s in group.sequences], np.float32)
    advantages = rewards - rewards.mean()
    data = []
    for seq, adv in zip(group.sequences, advantages, strict=True):
        full = prompt + list(seq.tokens)
        n_prompt, n = len(prompt) - 1, len(full) - 1
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={
                    "target_tokens": full[1:],
                    "logprobs": [0.0] * n_prompt + list(seq.logprobs),
                    "advantages": [0.0] * n_prompt + [float(adv)] * len(seq.tokens),
                },
            )
        )
    fwd = trainer.forward_backward(data, "importance_sampling")
    opt = trainer.optim_step(ADAM)
    figures["rl_loss"].append(fwd.result().metrics["loss:sum"])
    opt.result()

    # In-flight sync while 16 long requests run: all finish with every token, no error.
    long_params = types.SamplingParams(max_tokens=768, temperature=1.0, seed=11)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        running = [
            pool.submit(
                lambda i=i: sampler.sample(
                    types.ModelInput.from_ints(prompt[: 32 + i]), 1, long_params
                ).result()
            )
            for i in range(16)
        ]
        time.sleep(1.0)
        started = time.perf_counter()
        synced = trainer.save_weights_and_get_sampling_client(kind="inflight").result()
        figures["inflight_sync_s"] = time.perf_counter() - started
        done = [f.result(timeout=600) for f in running]
    figures["inflight_requests_full_length"] = sum(len(r.sequences[0].tokens) == 768 for r in done)
    assert figures["inflight_requests_full_length"] == 16

    after = synced.sample(types.ModelInput.from_ints(prompt), 8, params).result()
    gap = logprob_gap(trainer, prompt, after.sequences)
    figures["gap_after_inflight_sync"] = {"mean": float(gap.mean()), "max": float(gap.max())}
    record("local_gpu_backend", figures)
    saved = trainer.save_state("final").result()
    figures["saved"] = saved.path
    record("local_gpu_backend", figures)
    assert figures["gap_after_sft"]["mean"] <= GAP_TOLERANCE
    assert figures["gap_after_inflight_sync"]["mean"] <= GAP_TOLERANCE
