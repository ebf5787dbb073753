"""The unmodified tinker SDK drives `oneloop serve` (local backend, tiny model, real Ray)."""

import asyncio

import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.types import RequestErrorCategory

from oneloop.backends.megatron_local.losses import compute_loss
from oneloop.backends.megatron_local.serve import ServeConfig, ServerThread
from oneloop.backends.sequence_ids import sampled_version
from oneloop.tiny.model import TINY_MODEL_NAME

pytestmark = pytest.mark.slow
CLIENT_KEY = "tml-any-key-on-loopback"


@pytest.fixture(scope="module")
def server(backend):
    # The SDK zstd-compresses forward_backward bodies when the server asks it to.
    # A short long-poll makes the SDK go through many 408 / try-again rounds.
    config = ServeConfig(port=0, compress_fwdbwd=True, long_poll_s=0.5)
    with ServerThread(config, backend) as thread:
        yield thread
        assert thread.service.internal_errors == 0  # the SDK retries 5xx silently


@pytest.fixture(scope="module")
def service_client(server):
    client = tinker.ServiceClient(base_url=server.base_url, api_key=CLIENT_KEY)
    yield client
    client.close("success").result(timeout=60)


@pytest.fixture(scope="module")
def training(service_client):
    return service_client.create_lora_training_client(TINY_MODEL_NAME, rank=4, seed=7).result(
        timeout=300
    )


def _datum(tokens, loss_fn, rng):
    n = len(tokens) - 1
    inputs = {"target_tokens": np.array(tokens[1:], np.int64)}
    if loss_fn == "cross_entropy":
        inputs["weights"] = np.ones(n, np.float32)
    else:
        inputs["logprobs"] = rng.uniform(-3, -0.5, n).astype(np.float32)
        inputs["advantages"] = rng.normal(size=n).astype(np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def _batch(loss_fn, count, seed=0, length=6):
    rng = np.random.default_rng(seed)
    return [_datum(rng.integers(300, 1000, length).tolist(), loss_fn, rng) for _ in range(count)]


CONFIGS = {"ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, "dro": {"beta": 0.1}}


def test_session_config_and_health_routes(server, service_client):
    rest = tinker.RestClient(base_url=server.base_url, api_key=CLIENT_KEY)
    caps = rest.get_server_capabilities().result(timeout=60)
    assert TINY_MODEL_NAME in {m.model_name for m in caps.supported_models}
    holder = service_client.holder
    assert holder.get_session_id() in server.service.registry.sessions
    assert holder.get_client_config().pjwt_auth_enabled is False
    assert holder.get_client_config().proto_compress_fwdbwd is True
    assert holder.get_client_dynamic_config().sample_cancel_enabled is True


def test_training_sampling_and_checkpoint_flow(server, service_client, training):
    info = training.get_info()
    assert info.model_id == training.model_id and info.model_data.model_name == TINY_MODEL_NAME
    assert info.lora_rank == 4

    for loss_fn in ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro"):
        fb = training.forward_backward(_batch(loss_fn, 3), loss_fn, CONFIGS.get(loss_fn))
        out = fb.result(timeout=300)
        assert np.isfinite(out.metrics["loss:sum"])
        assert [o["logprobs"].shape for o in out.loss_fn_outputs] == [[5]] * 3
    step = training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=300)
    assert step.metrics is not None

    saved = training.save_state("step-1").result(timeout=300)
    assert saved.path.startswith("tinker://") and saved.path.endswith("/weights/step-1")

    prompt = types.ModelInput.from_ints([301, 302, 303, 304])
    params = types.SamplingParams(max_tokens=4, seed=3, temperature=1.0)
    for kind in ("snapshot", "inflight"):
        sampler = training.save_weights_and_get_sampling_client(kind=kind).result(timeout=300)
        resp = sampler.sample(prompt, num_samples=2, sampling_params=params).result(timeout=300)
        assert len(resp.sequences) == 2
        assert all(
            0 < len(s.tokens) <= 4 and len(s.logprobs) == len(s.tokens) for s in resp.sequences
        )
        slot = server.service.registry.samplers[sampler._sampling_session_id]
        version = slot.client.result().version
        assert [sampled_version(s) for s in resp.sequences] == [version, version]
        assert len({s.sequence_id for s in resp.sequences}) == 2
        logprobs = sampler.compute_logprobs(prompt).result(timeout=300)
        assert logprobs[0] is None and all(np.isfinite(v) for v in logprobs[1:])
        last = sampler.compute_logprobs(prompt, prompt_logprobs_last_n=1).result(timeout=300)
        assert last[:-1] == [None] * 3 and last[-1] == pytest.approx(logprobs[-1], abs=1e-5)

    named = training.save_weights_for_sampler("named").result(timeout=300)
    assert named.path.endswith("/sampler_weights/named")
    from_path = service_client.create_sampling_client(model_path=named.path).result(timeout=300)
    assert from_path.sample(prompt, 1, params).result(timeout=300).sequences

    resumed = service_client.create_training_client_from_state_with_optimizer(saved.path).result(
        timeout=300
    )
    assert resumed.get_info().lora_rank == 4
    weights_only = service_client.create_training_client_from_state(saved.path).result(timeout=300)
    probe = _batch("cross_entropy", 2, seed=5)
    a = resumed.forward(probe, "cross_entropy").result(timeout=300)
    b = weights_only.forward(probe, "cross_entropy").result(timeout=300)
    for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(x["logprobs"].to_numpy(), y["logprobs"].to_numpy(), atol=1e-5)
    resumed.forward_backward(probe, "cross_entropy").result(timeout=300)
    resumed.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=300)

    rest = tinker.RestClient(base_url=server.base_url, api_key=CLIENT_KEY)
    run_id = saved.path.split("/")[2]
    listed = rest.list_checkpoints(run_id).result(timeout=60)
    assert {c.checkpoint_id for c in listed.checkpoints} >= {
        "weights/step-1",
        "sampler_weights/named",
    }
    assert rest.get_training_run(run_id).result(timeout=60).lora_rank == 4
    assert rest.get_weights_info_by_tinker_path(saved.path).result(timeout=60).lora_rank == 4
    rest.delete_checkpoint(run_id, "sampler_weights/named").result(timeout=60)
    listed = rest.list_checkpoints(run_id).result(timeout=60)
    assert "sampler_weights/named" not in {c.checkpoint_id for c in listed.checkpoints}
    runs = rest.list_training_runs().result(timeout=60)
    assert run_id in {r.training_run_id for r in runs.training_runs}
    assert training.get_tokenizer().encode("hello")


def test_bad_requests_fail_with_user_errors(training):
    bad = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={"target_tokens": np.array([1, 2], np.int64)},
    )
    with pytest.raises(tinker.RequestFailedError) as failed:
        training.forward_backward([bad], "cross_entropy").result(timeout=300)
    assert failed.value.category == types.RequestErrorCategory.User
    assert "weights" in str(failed.value)


def test_a_sample_that_fails_in_the_backend_is_a_failed_future(server, training):
    """Regression: a sample failing within the acknowledgement wait used to answer 500."""
    sampler = training.save_weights_and_get_sampling_client().result(timeout=300)
    out_of_vocab = types.ModelInput.from_ints([10**6])
    with pytest.raises(tinker.RequestFailedError):
        sampler.sample(out_of_vocab, 1, types.SamplingParams(max_tokens=2)).result(timeout=300)
    assert server.service.internal_errors == 0


def test_chunked_forward_backward_equals_the_in_process_call(server, service_client, backend):
    """1,100 datums go out as two chunks, sent in parallel with the first chunk last."""
    via_sdk = service_client.create_lora_training_client(TINY_MODEL_NAME, rank=4, seed=11)
    via_sdk = via_sdk.result(timeout=300)
    in_process = backend.create_lora_training_client(TINY_MODEL_NAME, rank=4, seed=11).result(
        timeout=300
    )
    data = _batch("importance_sampling", 1100, seed=1, length=4)
    probe = _batch("cross_entropy", 4, seed=2)
    adam = types.AdamParams(learning_rate=1e-2)

    # Same initial weights (same LoRA seed): forward agrees before any training.
    start_sdk = via_sdk.forward(probe, "cross_entropy").result(timeout=300)
    start_local = in_process.forward(probe, "cross_entropy").result(timeout=300)
    _assert_same_outputs(start_sdk, start_local)

    fb_sdk = via_sdk.forward_backward(data, "importance_sampling")
    step_sdk = via_sdk.optim_step(adam)
    fb_local = in_process.forward_backward(data, "importance_sampling").result(timeout=600)
    in_process.optim_step(adam).result(timeout=300)
    out_sdk = fb_sdk.result(timeout=600)
    step_sdk.result(timeout=300)
    assert len(out_sdk.loss_fn_outputs) == 1100
    # The second chunk reached the server before the first and waited for it.
    assert server.service.registry.models[via_sdk.model_id].sequencer.early_arrivals >= 1
    assert out_sdk.metrics["loss:sum"] == pytest.approx(fb_local.metrics["loss:sum"], rel=1e-4)
    _assert_same_outputs(out_sdk, fb_local)
    # The chunked gradients summed to the one-call gradient: the updated weights agree.
    _assert_same_outputs(
        via_sdk.forward(probe, "cross_entropy").result(timeout=300),
        in_process.forward(probe, "cross_entropy").result(timeout=300),
    )
    assert not _same(start_sdk, via_sdk.forward(probe, "cross_entropy").result(timeout=300))


def _same(a, b):
    return all(
        np.allclose(x["logprobs"].to_numpy(), y["logprobs"].to_numpy(), atol=1e-4)
        for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs, strict=True)
    )


def _assert_same_outputs(a, b):
    assert len(a.loss_fn_outputs) == len(b.loss_fn_outputs)
    assert _same(a, b)


def test_thousand_concurrent_samples_complete_without_leaks(server, training):
    sampler = training.save_weights_and_get_sampling_client().result(timeout=300)
    params = types.SamplingParams(max_tokens=2, seed=1)

    async def run_all():
        futures = [
            sampler.sample(types.ModelInput.from_ints([300 + i % 50, 301]), 1, params)
            for i in range(1000)
        ]
        return await asyncio.wait_for(asyncio.gather(*futures), timeout=900)

    results = asyncio.run(run_all())
    assert len(results) == 1000 and all(len(r.sequences) == 1 for r in results)
    ids = {r.sequences[0].sequence_id for r in results}
    assert len(ids) == 1000
    stats = server.service.store.stats()
    assert stats["pending"] == 0 and stats["running_tasks"] == 0 and stats["undelivered"] == 0


def test_retried_asample_returns_the_original_future(server, training):
    import httpx

    sampler = training.save_weights_and_get_sampling_client().result(timeout=300)
    body = {
        "num_samples": 2,
        "prompt": {"chunks": [{"tokens": [301, 302], "type": "encoded_text"}]},
        "sampling_params": {"max_tokens": 2, "seed": 5},
        "sampling_session_id": sampler._sampling_session_id,
        "seq_id": 10**6,
        "type": "sample",
    }
    url = f"{server.base_url}/api/v1"
    first = httpx.post(f"{url}/asample", json=body, timeout=60).json()
    again = httpx.post(f"{url}/asample", json=body, timeout=60).json()
    assert first == again and len(first["sample_sequence_ids"]) == 2
    other = httpx.post(f"{url}/asample", json=dict(body, num_samples=1), timeout=60)
    assert other.status_code == 409 and other.headers["x-should-retry"] == "false"
    for _ in range(600):  # 408 means "still running, poll again" (long_poll_s is 0.5 here)
        result = httpx.post(
            f"{url}/retrieve_future", json={"request_id": first["request_id"]}, timeout=60
        )
        if result.status_code != 408:
            break
    assert result.status_code == 200
    assert result.headers["content-type"] == "application/x-protobuf"
    from tinker.proto.response_conv import deserialize_sample_response

    assert len(deserialize_sample_response(result.content).sequences) == 2


def test_finished_session_rejects_heartbeats(server, backend):
    client = tinker.ServiceClient(base_url=server.base_url, api_key=CLIENT_KEY)
    session_id = client.holder.get_session_id()
    client.close("success", detail="done").result(timeout=60)
    session = server.service.registry.sessions[session_id]
    assert (session.finished, session.detail) == ("success", "done")
    import httpx

    r = httpx.post(
        f"{server.base_url}/api/v1/session_heartbeat",
        json={"session_id": session_id, "type": "session_heartbeat"},
        timeout=30,
    )
    assert r.status_code == 410


# SDK 0.38's newer built-in losses, on the same server and training client (last in this file: the
# gspo step moves the weights). `gspo` is computed by the trainer (checked against
# `losses.compute_loss` on the logprobs the server returns, and by the step it takes);
# `stable_reinforce` and `record_stability_info` are refused with their reason as a 4xx (the
# loss's objective is unpublished: `losses.py`), never a 5xx the SDK would retry.
GSPO_CLIP = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}


def _gspo_batch(seed: int, marks_per_datum: list[list[float]]) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for marks in marks_per_datum:
        n = len(marks)
        tokens = rng.integers(300, 1000, n + 1).tolist()
        inputs = {
            "target_tokens": np.array(tokens[1:], np.int64),
            "logprobs": rng.uniform(-8.0, -5.0, n).astype(np.float32),
            "advantages": rng.normal(size=n).astype(np.float32),
            "sequence_ratio_mask": np.array(marks, np.float32),
        }
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs=inputs))  # fmt: skip
    return data


def _expected(data: list[types.Datum], logprobs: list[np.ndarray]) -> tuple[float, float]:
    """gspo's summed loss and clipped-token count on the trainer's own logprobs, per datum."""
    total = clipped = 0.0
    for datum, lp in zip(data, logprobs, strict=True):
        inputs = {k: torch.from_numpy(v.to_numpy()).double()[None]
                  for k, v in datum.loss_fn_inputs.items() if k != "target_tokens"}  # fmt: skip
        lp_t = torch.from_numpy(np.asarray(lp, np.float64))[None]
        mask = torch.ones_like(lp_t, dtype=torch.bool)
        result = compute_loss("gspo", lp_t, inputs, mask, GSPO_CLIP)
        total += result.loss.item()
        clipped += result.metrics["clipped_tokens:sum"]
    return total, clipped


def test_gspo_forward_backward_through_the_sdk(training):
    # Unequal lengths (a ragged body), prompt-like unmarked positions, one datum fully marked.
    data = _gspo_batch(0, [[0, 0, 1, 1, 1], [1, 1, 1], [0, 1, 1, 1, 1, 1, 1]])
    out = training.forward_backward(data, "gspo", GSPO_CLIP).result(timeout=300)
    logprobs = [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]
    assert [len(lp) for lp in logprobs] == [5, 3, 7]
    loss, clipped = _expected(data, logprobs)
    assert out.metrics["loss:sum"] == pytest.approx(loss, rel=1e-4, abs=1e-4)
    assert out.metrics["clipped_tokens:sum"] == clipped
    # The sampler logprobs (-8..-5) are far below the tiny model's, so every sequence ratio is far
    # above 1.1: clipping is exercised, and the unclipped negative-advantage tokens still train.
    assert clipped == 15.0
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=300)
    after = training.forward(data, "gspo", GSPO_CLIP).result(timeout=300)
    moved = [np.abs(o["logprobs"].to_numpy() - lp).max()
             for o, lp in zip(after.loss_fn_outputs, logprobs, strict=True)]  # fmt: skip
    assert max(moved) > 1e-4


def _refused(future, needle: str) -> str:
    """The user-error message a training call fails with: the server answers a bad
    forward_backward through its future (category User, which the SDK does not retry)."""
    with pytest.raises(tinker.RequestFailedError) as info:
        future.result(timeout=300)
    assert info.value.category == RequestErrorCategory.User
    assert needle in info.value.message
    return info.value.message


def test_gspo_bad_requests_are_user_errors_naming_the_field(training):
    # All-zero mask on datum 1: the fast decoder declines it, the reference path names it.
    data = _gspo_batch(1, [[1, 1, 1], [0, 0, 0]])
    _refused(training.forward_backward(data, "gspo", GSPO_CLIP),
             "datum 1: loss_fn_inputs['sequence_ratio_mask'] marks no token (all zeros)")
    ok = _gspo_batch(1, [[1, 1, 1]])
    _refused(training.forward_backward(ok, "gspo"),
             "loss_fn_config['clip_low_threshold'] is required by loss 'gspo'")
    no_mask = [types.Datum(model_input=d.model_input,
                           loss_fn_inputs={k: v for k, v in d.loss_fn_inputs.items()
                                           if k != "sequence_ratio_mask"}) for d in ok]
    _refused(training.forward_backward(no_mask, "gspo", GSPO_CLIP),
             "loss_fn_inputs['sequence_ratio_mask'] is required by loss 'gspo'")  # fmt: skip


def test_stable_reinforce_and_record_stability_info_are_refused_with_the_reason(training):
    data = _gspo_batch(2, [[1, 1, 1]])
    for datum in data:
        del datum.loss_fn_inputs["sequence_ratio_mask"]
    _refused(training.forward_backward(data, "stable_reinforce", {"kl_coeff": 0.1}),
             "'stable_reinforce' is not supported")  # fmt: skip
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result(
        timeout=300
    )
    prompt = types.ModelInput.from_ints([301, 302, 303])
    params = types.SamplingParams(max_tokens=2, seed=1)
    with pytest.raises(tinker.BadRequestError,
                       match="record_stability_info: not supported by the local backend"):
        sampler.sample(prompt, num_samples=1, sampling_params=params).result(timeout=300)
    plain = training.save_weights_and_get_sampling_client().result(timeout=300)
    resp = plain.sample(prompt, num_samples=2, sampling_params=params).result(timeout=300)
    assert len({s.sequence_id for s in resp.sequences}) == 2
