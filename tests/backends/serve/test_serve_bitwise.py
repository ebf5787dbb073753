"""SDK → `oneloop serve` gives the same bits as the same calls in process, token by token.

The official `tinker` SDK drives a server over the session's local backend, and the same calls go
straight to that backend; both runs start from the same LoRA seed and make the same calls:
forward_backward → optim_step → save_state → `create_training_client_from_state_with_optimizer` →
forward_backward → optim_step → forward → sampling. Compared exactly (no tolerance): every
per-token logprob (so every per-datum loss), the loss and step metrics, the saved weights, and the
sampled tokens and their logprobs with a seed. A wire codec that rounds, reorders or drops
anything, or a resume through the server that loses optimizer state, shows up here.
"""

import numpy as np
import pytest
import tinker
from safetensors.numpy import load_file
from tinker import types

from oneloop.backends.megatron_local.checkpoints import TinkerPath
from oneloop.backends.megatron_local.serve import ServeConfig, ServerThread
from oneloop.tiny.model import TINY_MODEL_NAME

pytestmark = pytest.mark.slow
CLIENT_KEY = "tml-any-key-on-loopback"
TIMEOUT_S = 300
ADAM = types.AdamParams(learning_rate=2e-2, weight_decay=0.01, grad_clip_norm=0.0)


@pytest.fixture(scope="module")
def server(local_service):
    with ServerThread(ServeConfig(port=0, compress_fwdbwd=True), local_service) as thread:
        yield thread
        assert thread.service.internal_errors == 0


@pytest.fixture(scope="module")
def service_client(server):
    client = tinker.ServiceClient(base_url=server.base_url, api_key=CLIENT_KEY)
    yield client
    client.close("success").result(timeout=60)


def _batch(loss_fn: str, count: int, seed: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(count):
        tokens = rng.integers(300, 1000, int(rng.integers(5, 14))).tolist()
        n = len(tokens) - 1
        inputs: dict = {"target_tokens": np.array(tokens[1:], np.int64)}
        if loss_fn == "cross_entropy":
            inputs["weights"] = rng.uniform(0, 1, n).astype(np.float32)
        else:
            inputs["logprobs"] = rng.uniform(-3, -0.5, n).astype(np.float32)
            inputs["advantages"] = rng.normal(size=n).astype(np.float32)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs=inputs))  # fmt: skip
    return data


def _run(service, client, run_dir) -> dict:
    """The call sequence, from a fresh client to sampling; everything it saw, by name."""
    seen: dict = {}

    def forward_backward(name: str, data, loss_fn: str, config=None, forward_only=False):
        call = client.forward if forward_only else client.forward_backward
        out = call(data, loss_fn, config).result(timeout=TIMEOUT_S)
        seen[f"{name}.metrics"] = out.metrics
        seen[f"{name}.logprobs"] = [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]

    forward_backward("fb1", _batch("importance_sampling", 5, seed=1), "importance_sampling")
    seen["step1"] = client.optim_step(ADAM).result(timeout=TIMEOUT_S).metrics
    path = client.save_state("bitwise").result(timeout=TIMEOUT_S).path
    seen["weights"] = load_file(
        TinkerPath.parse(path).directory(run_dir) / "trainable.safetensors"
    )
    client = service.create_training_client_from_state_with_optimizer(path)
    client = client.result(timeout=TIMEOUT_S)
    ppo = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    forward_backward("fb2", _batch("ppo", 4, seed=2), "ppo", ppo)
    seen["step2"] = client.optim_step(ADAM).result(timeout=TIMEOUT_S).metrics
    forward_backward("probe", _batch("cross_entropy", 3, seed=3), "cross_entropy",
                     forward_only=True)  # fmt: skip
    sampler = client.save_weights_and_get_sampling_client().result(timeout=TIMEOUT_S)
    prompt = types.ModelInput.from_ints([301, 302, 303, 304, 305])
    params = types.SamplingParams(max_tokens=12, seed=17, temperature=1.0, stop=[])
    sampled = sampler.sample(prompt, 3, params).result(timeout=TIMEOUT_S).sequences
    seen["sampled"] = [(s.tokens, s.logprobs, s.stop_reason) for s in sampled]
    seen["prompt_logprobs"] = sampler.compute_logprobs(prompt).result(timeout=TIMEOUT_S)
    return seen


def test_sdk_through_serve_equals_in_process_bit_for_bit(service_client, local_service):
    kwargs = {"rank": 4, "seed": 23}
    via_serve = service_client.create_lora_training_client(TINY_MODEL_NAME, **kwargs)
    via_serve = via_serve.result(timeout=TIMEOUT_S)
    in_process = local_service.create_lora_training_client(TINY_MODEL_NAME, **kwargs)
    run_dir = local_service.run_dir  # the server's backend: checkpoints of both land there
    a = _run(service_client, via_serve, run_dir)
    b = _run(local_service, in_process.result(timeout=TIMEOUT_S), run_dir)
    assert a.keys() == b.keys()
    for name in ("fb1", "fb2", "probe"):
        assert a[f"{name}.metrics"] == b[f"{name}.metrics"], name
        for i, (x, y) in enumerate(zip(a[f"{name}.logprobs"], b[f"{name}.logprobs"],
                                       strict=True)):  # fmt: skip
            assert x.dtype == y.dtype == np.float32, (name, i, x.dtype, y.dtype)
            assert np.array_equal(x, y), (name, i, x - y)
    assert a["step1"] == b["step1"] and a["step2"] == b["step2"]
    assert a["step1"]["grad_norm:mean"] > 0
    assert a["weights"].keys() == b["weights"].keys()
    for key in a["weights"]:
        assert np.array_equal(a["weights"][key], b["weights"][key]), key
    assert a["sampled"] == b["sampled"]
    assert len({tuple(tokens) for tokens, _, _ in a["sampled"]}) > 1  # the seed draws rows apart
    assert a["prompt_logprobs"] == b["prompt_logprobs"]
