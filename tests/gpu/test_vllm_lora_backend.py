"""A LoRA run on the local backend on GPU: Ray, a `torch` trainer actor (LoRA, CUDA) and a `vllm`
sampler actor that serves the run's adapters as vLLM LoRA modules, on one GPU, driven through the
Tinker client surface.

Checks: a LoRA layout vLLM cannot serve (lm_head) is refused before anything starts; two
`snapshot` clients and an `inflight` client of one run sample at once, each on its own version
(the older snapshot keeps sampling its own adapter after the trainer moved on); sampled-token
logprobs equal the trainer's target logprobs on the same tokens (mean |Δ| ≤ 0.01, bf16); an
inflight publish while 16 long requests run completes them all on the version they started on;
every publish took the adapter path; a `save_weights_for_sampler` path loads as an adapter too.
Device only; figures → $OUT/vllm_lora_backend.json.
"""

import concurrent.futures
import time

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("ray")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gpu_figures import model_dir, record  # noqa: E402
from tinker import types  # noqa: E402

from oneloop.backends import connect  # noqa: E402
from oneloop.backends.config import BackendConfig, LocalBackendConfig, VllmSettings  # noqa: E402
from oneloop.backends.sequence_ids import sampled_version  # noqa: E402
from oneloop.errors import CapabilityError  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1200)]
MODEL = "qwen3-0.6b-random"
RANK = 16
GAP_TOLERANCE = 0.01
# LoRA moves from zero-initialised B: a large step size so two versions differ clearly.
ADAM = types.AdamParams(learning_rate=1e-2, weight_decay=0.0, grad_clip_norm=1.0)
NAME = "vllm_lora_backend"


def sft_datum(rng: np.random.Generator, n: int) -> types.Datum:
    tokens = rng.integers(1000, 150000, n + 1).tolist()
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n},
    )


def train(trainer, rng: np.random.Generator, steps: int) -> None:
    for _ in range(steps):
        fwd = trainer.forward_backward([sft_datum(rng, 256) for _ in range(8)], "cross_entropy")
        opt = trainer.optim_step(ADAM)
        fwd.result()
        opt.result()


def logprob_gap(trainer, prompt: list[int], sequences) -> np.ndarray:
    """|sampler logprob − trainer target logprob| over every sampled token."""
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints((prompt + list(s.tokens))[:-1]),
            loss_fn_inputs={
                "target_tokens": (prompt + list(s.tokens))[1:],
                "weights": [1.0] * (len(prompt) + len(s.tokens) - 1),
            },
        )
        for s in sequences
    ]
    out = trainer.forward(data, "cross_entropy").result()
    gaps = [
        np.abs(lp["logprobs"].to_numpy()[len(prompt) - 1 :] - np.asarray(s.logprobs, np.float32))
        for s, lp in zip(sequences, out.loss_fn_outputs, strict=True)
    ]
    return np.concatenate(gaps)


def summary(gap: np.ndarray) -> dict:
    return {"mean": float(gap.mean()), "max": float(gap.max()), "tokens": int(gap.size)}


def test_lora_run_publishes_adapters_to_vllm_through_ray(tmp_path_factory) -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_gpus=1, include_dashboard=False)
    config = BackendConfig(
        backend="local",
        run_dir=tmp_path_factory.mktemp("run"),
        models={MODEL: model_dir(tmp_path_factory.mktemp("model"))},
        local=LocalBackendConfig(
            trainer_engine="torch",
            sampler_engine="vllm",
            device="cuda",
            dtype="bfloat16",
            gpus_per_trainer=0.25,
            gpus_per_sampler=0.5,
            vllm=VllmSettings(gpu_memory_utilization=0.3, max_model_len=2048),
        ),
    )
    service = connect(config)
    figures: dict = {}
    try:
        with pytest.raises(CapabilityError, match="train_unembed=False"):
            service.create_lora_training_client(MODEL, rank=RANK)
        trainer = service.create_lora_training_client(
            MODEL, rank=RANK, seed=0, train_unembed=False
        ).result()
        rng = np.random.default_rng(0)
        prompt = rng.integers(1000, 150000, 64).tolist()
        model_input = types.ModelInput.from_ints(prompt)
        params = types.SamplingParams(max_tokens=64, temperature=1.0, seed=7)

        train(trainer, rng, 2)
        first = trainer.save_weights_and_get_sampling_client(kind="snapshot").result()
        group = first.sample(model_input, 8, params).result()
        figures["gap_snapshot_1"] = summary(logprob_gap(trainer, prompt, group.sequences))
        record(NAME, figures)

        train(trainer, rng, 2)
        second = trainer.save_weights_and_get_sampling_client(kind="snapshot").result()
        inflight = trainer.save_weights_and_get_sampling_client(kind="inflight").result()
        groups = {
            name: client.sample(model_input, 8, params).result()
            for name, client in (("first", first), ("second", second), ("inflight", inflight))
        }
        figures["versions"] = {
            name: sorted({sampled_version(s) for s in g.sequences}) for name, g in groups.items()
        }
        for name, key in (("second", "gap_snapshot_2"), ("inflight", "gap_inflight"),
                          ("first", "gap_first_vs_trainer_now")):  # fmt: skip
            # the first snapshot still samples its own (older) adapter: far from the trainer now
            figures[key] = summary(logprob_gap(trainer, prompt, groups[name].sequences))
        record(NAME, figures)

        # An inflight publish while 16 long requests run: all finish, on the version they began.
        long_params = types.SamplingParams(max_tokens=768, temperature=1.0, seed=11)
        train(trainer, rng, 1)  # the next version, published while the requests run
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            running = [
                pool.submit(
                    lambda i=i: inflight.sample(
                        types.ModelInput.from_ints(prompt[: 32 + i]), 1, long_params
                    ).result()
                )
                for i in range(16)
            ]
            time.sleep(1.0)
            started = time.perf_counter()
            newer = trainer.save_weights_and_get_sampling_client(kind="inflight").result()
            figures["inflight_publish_s"] = time.perf_counter() - started
            unfinished_at_publish = sum(not f.done() for f in running)
            done = [f.result(timeout=600) for f in running]
        figures["inflight_requests"] = {
            "unfinished_at_publish": unfinished_at_publish,
            "full_length": sum(len(r.sequences[0].tokens) == 768 for r in done),
            "versions": sorted({sampled_version(r.sequences[0]) for r in done}),
        }
        after = newer.sample(model_input, 8, params).result()
        figures["gap_after_inflight_publish"] = summary(
            logprob_gap(trainer, prompt, after.sequences)
        )
        figures["version_after_inflight_publish"] = sorted(
            {sampled_version(s) for s in after.sequences}
        )

        saved = trainer.save_weights_for_sampler("final").result()
        from_path = service.create_sampling_client(model_path=saved.path).result()
        path_group = from_path.sample(model_input, 4, params).result()
        figures["gap_from_path"] = summary(logprob_gap(trainer, prompt, path_group.sequences))

        ((sampler_actor,),) = [p.actors for p in service._samplers.values()]
        history = ray.get(sampler_actor.sync_history.remote(), timeout=60)
        figures["sync_history"] = history
        record(NAME, figures)

        assert figures["versions"] == {"first": [1], "second": [2], "inflight": [3]}
        assert figures["inflight_requests"] == {
            "unfinished_at_publish": 16, "full_length": 16, "versions": [3]
        }  # fmt: skip
        assert figures["version_after_inflight_publish"] == [4]
        assert {h["path"] for h in history} == {"lora"} and len(history) == 5, history
        for key in ("gap_snapshot_1", "gap_snapshot_2", "gap_inflight",
                    "gap_after_inflight_publish", "gap_from_path"):  # fmt: skip
            assert figures[key]["mean"] <= GAP_TOLERANCE, (key, figures[key])
        assert figures["gap_first_vs_trainer_now"]["mean"] >= 5 * GAP_TOLERANCE
    finally:
        service.close()
        ray.shutdown()
