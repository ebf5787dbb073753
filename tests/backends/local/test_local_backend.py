"""The local backend through its Tinker-shaped clients, on real Ray actors, torch engines."""

import asyncio

import numpy as np
import pytest
from safetensors.numpy import load_file
from tinker import types

from oneloop.backends.megatron_local.checkpoints import TinkerPath
from oneloop.backends.sequence_ids import sampled_version
from oneloop.errors import CapabilityError, CheckpointNotFoundError, RequestError
from oneloop.tiny.model import TINY_MODEL_NAME

ADAM = types.AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)


def make_datum(tokens: list[int], loss_fn: str = "cross_entropy", seed: int = 0) -> types.Datum:
    rng = np.random.default_rng(seed)
    n = len(tokens) - 1
    inputs: dict = {"target_tokens": tokens[1:]}
    if loss_fn == "cross_entropy":
        inputs["weights"] = [1.0] * n
    else:
        inputs["logprobs"] = (-rng.random(n) * 3).astype(np.float32)
        inputs["advantages"] = rng.standard_normal(n).astype(np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def random_tokens(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 1000, size=length).tolist()


def trainable_weights(trainer, name: str) -> dict[str, np.ndarray]:
    path = trainer.save_state(name).result().path
    directory = TinkerPath.parse(path).directory(trainer._service.run_dir)
    return load_file(str(directory / "trainable.safetensors"))


@pytest.fixture(scope="module")
def trainer(local_service):
    return local_service.create_lora_training_client(TINY_MODEL_NAME, rank=8, seed=3).result()


def test_one_batch_equals_two_halves_accumulated(local_service):
    """Gradients accumulate across forward_backward calls until optim_step (losses are sums).

    Regression: this compared the weights after one clipped AdamW step, which does not depend on
    the gradient's scale, so averaging each call's gradient instead of summing passed. Now each
    step's reported grad norm is compared, and the weights after two unclipped steps whose calls
    are split differently on the two sides (a per-call scale cannot cancel out across steps)."""
    first = [make_datum(random_tokens(i, 20 + 7 * i), "ppo", i) for i in range(6)]
    second = [make_datum(random_tokens(10 + i, 18 + 5 * i), "ppo", 10 + i) for i in range(4)]
    unclipped = ADAM.model_copy(update={"grad_clip_norm": 0.0})
    # Step by step, the calls each side makes: `a` sends step 1 whole and step 2 in two calls
    # (1 + 3 datums), `b` the other way round (3 + 3 datums, then 4).
    plans = {"a": [[first], [second[:1], second[1:]]], "b": [[first[:3], first[3:]], [second]]}
    losses: dict[str, list[float]] = {}
    norms: dict[str, list[float]] = {}
    clients = {}
    for side, steps in plans.items():
        client = local_service.create_lora_training_client(TINY_MODEL_NAME, rank=4, seed=11)
        clients[side] = client = client.result()
        if side == "a":
            w0 = trainable_weights(client, "init")
        for calls in steps:
            outs = [client.forward_backward(call, "ppo") for call in calls]
            losses.setdefault(side, []).append(sum(o.result().metrics["loss:sum"] for o in outs))
            step = client.optim_step(unclipped).result()
            norms.setdefault(side, []).append(step.metrics["grad_norm:mean"])
    assert losses["a"] == pytest.approx(losses["b"], rel=1e-5)
    assert all(n > 0 for n in norms["a"]), norms
    assert norms["a"] == pytest.approx(norms["b"], rel=1e-5), norms
    wa, wb = trainable_weights(clients["a"], "whole"), trainable_weights(clients["b"], "halves")
    assert wa.keys() == wb.keys()
    for key in wa:
        np.testing.assert_allclose(wa[key], wb[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert any(not np.allclose(w0[k], wa[k]) for k in wa), "optim_step did not change the weights"


def test_microbatching_does_not_change_results(tmp_path, tiny_model_path):
    """A tiny token budget (one datum per micro-batch) gives the same loss and logprobs."""
    from oneloop.backends.megatron_local.engines.base import LoraSpec
    from oneloop.backends.megatron_local.engines.microbatch import pack_microbatches
    from oneloop.backends.megatron_local.engines.torch.trainer import TorchTrainerEngine
    from oneloop.backends.megatron_local.training_client import datum_to_arrays

    assert pack_microbatches([5, 5, 5, 9], 10) == [[0, 1], [2], [3]]
    data = [
        datum_to_arrays(make_datum(random_tokens(i, 10 + i)), "cross_entropy", i) for i in range(5)
    ]
    big = TorchTrainerEngine(tiny_model_path, LoraSpec(4, seed=1), max_tokens_per_microbatch=4096)
    small = TorchTrainerEngine(tiny_model_path, LoraSpec(4, seed=1), max_tokens_per_microbatch=8)
    rb = big.forward_backward(data, "cross_entropy", None, forward_only=False)
    rs = small.forward_backward(data, "cross_entropy", None, forward_only=False)
    assert rb.loss == pytest.approx(rs.loss, rel=1e-5)
    for x, y in zip(rb.logprobs, rs.logprobs, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5)


def test_seeds_and_sampling_params(trainer):
    sampler = trainer.save_weights_and_get_sampling_client(kind="snapshot").result()
    prompt = types.ModelInput.from_ints(random_tokens(5, 12))
    params = types.SamplingParams(max_tokens=16, seed=123, stop=[])
    first = sampler.sample(prompt, 3, params).result()
    again = sampler.sample(prompt, 3, params).result()
    other = sampler.sample(prompt, 3, params.model_copy(update={"seed": 124})).result()
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    assert [s.tokens for s in first.sequences] != [s.tokens for s in other.sequences]
    assert all(len(s.tokens) == 16 and s.stop_reason == "length" for s in first.sequences)
    assert len({tuple(s.tokens) for s in first.sequences}) > 1, "num_samples drew identical rows"
    # A token-id stop ends the sequence on (and including) that token.
    stop_token = first.sequences[0].tokens[4]
    stopped = sampler.sample(prompt, 1, params.model_copy(update={"stop": [stop_token]})).result()
    seq = stopped.sequences[0]
    assert seq.stop_reason == "stop" and seq.tokens[-1] == stop_token
    assert seq.tokens == first.sequences[0].tokens[: len(seq.tokens)]
    # A string stop ends on the token that completes the string.
    tokenizer = trainer.get_tokenizer()
    text = tokenizer.decode(first.sequences[0].tokens)
    needle = text[len(text) // 2 : len(text) // 2 + 2]
    by_string = sampler.sample(prompt, 1, params.model_copy(update={"stop": [needle]})).result()
    seq = by_string.sequences[0]
    assert seq.stop_reason == "stop" and needle in tokenizer.decode(seq.tokens)
    assert needle not in tokenizer.decode(seq.tokens[:-1])
    # Greedy, top-k = 1 and a tiny top-p all pick the argmax token.
    greedy = sampler.sample(prompt, 2, params.model_copy(update={"temperature": 0.0})).result()
    top1 = sampler.sample(prompt, 2, params.model_copy(update={"top_k": 1, "seed": 9})).result()
    nucleus = sampler.sample(prompt, 2, params.model_copy(update={"top_p": 1e-6})).result()
    assert greedy.sequences[0].tokens == top1.sequences[1].tokens == nucleus.sequences[0].tokens


def test_trainer_sampler_logprob_gap(trainer):
    """Target logprobs from forward_backward vs the sampler's on sampled tokens: < 1e-5 (fp32)."""
    sampler = trainer.save_weights_and_get_sampling_client(kind="inflight").result()
    prompt = random_tokens(8, 20)
    out = sampler.sample(
        types.ModelInput.from_ints(prompt), 4, types.SamplingParams(max_tokens=24, seed=1, stop=[])
    ).result()
    data = [make_datum(prompt + s.tokens) for s in out.sequences]
    result = trainer.forward_backward(data, "cross_entropy").result()
    gaps = []
    for seq, lp in zip(out.sequences, result.loss_fn_outputs, strict=True):
        trainer_lp = lp["logprobs"].to_numpy()[len(prompt) - 1 :]
        gaps.append(np.abs(trainer_lp - np.asarray(seq.logprobs)))
    assert float(np.concatenate(gaps).mean()) < 1e-5
    assert "loss:sum" in result.metrics
    assert result.metrics["loss:sum"] == pytest.approx(
        -sum(float(lp["logprobs"].to_numpy().sum()) for lp in result.loss_fn_outputs), rel=1e-5
    )
    trainer.optim_step(types.AdamParams(learning_rate=0.0)).result()  # drop the accumulated grads


def test_inflight_and_snapshot_contracts(local_service):
    trainer = local_service.create_lora_training_client(TINY_MODEL_NAME, rank=8, seed=5).result()
    probe = types.ModelInput.from_ints(random_tokens(9, 30))
    snapshot = trainer.save_weights_and_get_sampling_client(kind="snapshot").result()
    inflight = trainer.save_weights_and_get_sampling_client(kind="inflight").result()
    before = np.array(snapshot.compute_logprobs(probe).result()[1:], dtype=np.float64)
    np.testing.assert_allclose(inflight.compute_logprobs(probe).result()[1:], before, atol=1e-6)
    data = [make_datum(random_tokens(i, 40)) for i in range(4)]
    trainer.forward_backward(data, "cross_entropy")
    trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    newer = trainer.save_weights_and_get_sampling_client(kind="inflight").result()
    after_new = np.array(newer.compute_logprobs(probe).result()[1:], dtype=np.float64)
    # The inflight client made before the update now samples on the newer weights...
    after_old_inflight = np.array(inflight.compute_logprobs(probe).result()[1:], dtype=np.float64)
    np.testing.assert_allclose(after_old_inflight, after_new, atol=1e-6)
    assert np.abs(after_new - before).max() > 1e-3, "training did not change the sampler"
    # ... while the snapshot keeps its weights.
    np.testing.assert_allclose(snapshot.compute_logprobs(probe).result()[1:], before, atol=1e-6)
    # Versions: each sample records the version it started on; the update bumped it.
    params = types.SamplingParams(max_tokens=4, seed=0)
    v_old = sampled_version(inflight.sample(probe, 1, params).result().sequences[0])
    v_snap = sampled_version(snapshot.sample(probe, 1, params).result().sequences[0])
    assert v_old is not None and v_snap is not None and v_old > v_snap
    # Sampler weights match what the trainer now computes.
    fwd = trainer.forward([make_datum(probe.to_ints() + [5])], "cross_entropy").result()
    np.testing.assert_allclose(
        fwd.loss_fn_outputs[0]["logprobs"].to_numpy()[:-1], after_new, atol=1e-5
    )
    # More snapshots than local.max_snapshots (2): the oldest fails with a clear error.
    for _ in range(2):
        trainer.save_weights_and_get_sampling_client(kind="snapshot").result()
    with pytest.raises(RequestError, match="evicted"):
        snapshot.compute_logprobs(probe).result()


def test_save_state_with_optimizer_resumes_exactly(local_service):
    data = [make_datum(random_tokens(20 + i, 25), "importance_sampling", i) for i in range(3)]
    probe = [make_datum(random_tokens(99, 25))]
    run = local_service.create_lora_training_client(TINY_MODEL_NAME, rank=8, seed=2).result()
    for _ in range(2):
        run.forward_backward(data, "importance_sampling")
        run.optim_step(ADAM)
    path = run.save_state("mid").result().path
    assert path == f"tinker://{run.model_id}/weights/mid"
    resumed = local_service.create_training_client_from_state_with_optimizer(path).result()
    weights_only = local_service.create_training_client_from_state(path).result()
    losses = []
    for client in (run, resumed, weights_only):
        client.forward_backward(data, "importance_sampling")
        client.optim_step(ADAM).result()
        losses.append(client.forward(probe, "cross_entropy").result().metrics["loss:sum"])
    assert losses[1] == pytest.approx(losses[0], rel=1e-6, abs=1e-6)
    assert losses[2] != pytest.approx(losses[0], rel=1e-6, abs=1e-6), (
        "restoring without the optimizer should differ (fresh Adam moments)"
    )


def test_sampler_checkpoint_by_path_and_full_finetune(local_service):
    full = local_service.create_lora_training_client(TINY_MODEL_NAME, rank=0, seed=1).result()
    assert full.get_info().is_lora is False
    full.forward_backward([make_datum(random_tokens(1, 30))], "cross_entropy")
    full.optim_step(ADAM).result()
    saved = full.save_weights_for_sampler("final").result().path
    by_path = local_service.create_sampling_client(model_path=saved).result()
    live = full.save_weights_and_get_sampling_client().result()
    probe = types.ModelInput.from_ints(random_tokens(2, 20))
    np.testing.assert_allclose(
        by_path.compute_logprobs(probe).result()[1:],
        live.compute_logprobs(probe).result()[1:],
        atol=1e-6,
    )
    base = local_service.create_sampling_client(base_model=TINY_MODEL_NAME).result()
    assert base.compute_logprobs(probe).result()[0] is None


def test_futures_are_awaitable_and_ordered(trainer):
    """A model's calls run in submission order, whoever awaits first.

    Regression: the step between the two forwards had learning rate 0, so running it before the
    first forward or after the second changed nothing; now it moves the weights."""
    data = [make_datum(random_tokens(3, 16))]

    async def go():
        grads = trainer.forward_backward(data, "cross_entropy")
        first = trainer.forward(data, "cross_entropy")
        step = trainer.optim_step(types.AdamParams(learning_rate=5e-2))
        second = trainer.forward(data, "cross_entropy")
        # Awaited in reverse order of submission.
        return await second, await step, await first, await grads

    second, step, first, grads = asyncio.run(go())
    assert isinstance(first, types.ForwardBackwardOutput)
    assert isinstance(step, types.OptimStepResponse)
    before, after = first.metrics["loss:sum"], second.metrics["loss:sum"]
    assert before == pytest.approx(grads.metrics["loss:sum"], rel=1e-6)  # ran before the step
    assert after < before - 1e-2, (before, after)  # ran after it: the step lowered this loss
    settled = trainer.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert after == pytest.approx(settled, rel=1e-6)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda t: t.forward_backward(
                [
                    types.Datum(
                        model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]},
                    )
                ],
                "cross_entropy",
            ),
            "target_tokens",
        ),
        (lambda t: t.forward_backward([make_datum([1, 2, 3, 4])], "ppo"), "logprobs"),
        (lambda t: t.forward_backward([make_datum([1, 2, 3, 4])], "nope"), "nope"),
        (
            lambda t: t.forward_backward(
                [
                    types.Datum(
                        model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={
                            "target_tokens": [2, 3, 4],
                            "logprobs": [0.0, 0.0, 0.0],
                            "advantages": [1.0, float("nan"), 0.0],
                        },
                    )
                ],
                "importance_sampling",
            ),
            "advantages",
        ),
        (
            lambda t: t._service.create_training_client_from_state(
                "tinker://run-missing/weights/nothing"
            ),
            "no checkpoint",
        ),
        (lambda t: t._service.create_training_client_from_state("tinker://../weights/x"), "run id"),
        (lambda t: t._service.create_lora_training_client(TINY_MODEL_NAME, rank=4096), "rank"),
        (lambda t: t._service.create_lora_training_client("no/such-model", rank=4), "base_model"),
        (lambda t: t.optim_step(types.AdamParams(learning_rate=-1.0)), "learning_rate"),
    ],
)
def test_bad_input_names_the_field(trainer, make, match):
    with pytest.raises(
        (RequestError, CapabilityError, CheckpointNotFoundError, ValueError), match=match
    ):
        make(trainer)


def test_sampler_actor_crash_is_survived(local_service):
    """Regression: a crashed sampler actor used to fail every later sample; Ray now restarts it
    and the client re-installs its own weights, so sampling continues on the same weights."""
    import ray

    trainer = local_service.create_lora_training_client(TINY_MODEL_NAME, rank=4, seed=8).result()
    trainer.forward_backward([make_datum(random_tokens(4, 30))], "cross_entropy")
    trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    client = trainer.save_weights_and_get_sampling_client(kind="inflight").result()
    probe = types.ModelInput.from_ints(random_tokens(6, 25))
    before = client.compute_logprobs(probe).result()
    (actor,) = client._pool.actors
    ray.kill(actor, no_restart=False)  # a crash: Ray restarts the actor with base weights
    after = client.compute_logprobs(probe).result(timeout=300)
    np.testing.assert_allclose(after[1:], before[1:], atol=1e-6)
    out = client.sample(probe, 1, types.SamplingParams(max_tokens=4, seed=0)).result(timeout=300)
    assert sampled_version(out.sequences[0]) == client.version
