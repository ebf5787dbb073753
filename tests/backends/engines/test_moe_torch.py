"""The seed's model families on the torch engines (CPU, fp32): tiny random Qwen3-MoE, Qwen3.5-MoE
(Gated DeltaNet hybrid, text only) and Qwen3.5 dense train and sample; the trainer-vs-sampler
logprob gap stays below 1e-5; rollout routing replay (R3) feeds the sampler's recorded experts
to the trainer's expert computation, exactly, per MoE layer and position."""

import json

import numpy as np
import pytest
import torch

from oneloop.backends.megatron_local.engines.base import DatumArrays, LoraSpec, SampleRequest
from oneloop.backends.megatron_local.engines.torch.routing import moe_routers
from oneloop.backends.megatron_local.engines.torch.sampler import TorchSamplerEngine
from oneloop.backends.megatron_local.engines.torch.trainer import TorchTrainerEngine
from oneloop.tiny.model import (
    TINY_QWEN3_5,
    TINY_QWEN3_5_MOE,
    TINY_QWEN3_MOE,
    build_tiny_model,
    named_tiny_specs,
)

ADAM = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0}
PROMPTS = [np.arange(5, 12), np.arange(30, 42)]


def _rollouts(sampler: TorchSamplerEngine) -> list:
    """(prompt, sequence) pairs of one batched sample call: 2 prompts × 2 samples."""
    requests = [SampleRequest(prompt=p, num_samples=2, max_tokens=12, seed=3) for p in PROMPTS]
    outputs = sampler._sample_batch("base", requests)
    return [(p, seq) for p, out in zip(PROMPTS, outputs, strict=True) for seq in out.sequences]


def _datum(prompt: np.ndarray, seq, replay: bool) -> DatumArrays:
    full = np.concatenate([prompt, seq.tokens]).astype(np.int64)
    logprobs = np.zeros(len(full) - 1, np.float32)
    logprobs[len(prompt) - 1 :] = seq.logprobs
    advantages = (logprobs != 0).astype(np.float32)
    return DatumArrays(
        full[:-1],
        full[1:],
        {"logprobs": logprobs, "advantages": advantages},
        routing=seq.routed_experts if replay else None,
    )


def _gap(result, rollouts) -> float:
    return max(
        float(np.abs(lp[len(p) - 1 :] - seq.logprobs).max())
        for lp, (p, seq) in zip(result.logprobs, rollouts, strict=True)
    )


@pytest.mark.parametrize("name", [TINY_QWEN3_MOE, TINY_QWEN3_5_MOE, TINY_QWEN3_5])
def test_family_trains_and_samples_with_fp32_gap_below_1e5(name):
    path = build_tiny_model(named_tiny_specs()[name])
    sampler = TorchSamplerEngine(path, threads=1)
    trainer = TorchTrainerEngine(path, LoraSpec(rank=0), threads=1)
    moe = bool(trainer.routers)
    assert moe == (name != TINY_QWEN3_5)
    rollouts = _rollouts(sampler)
    for prompt, seq in rollouts:
        if moe:
            layers, k = len(trainer.routers), int(trainer.routers[0].top_k)
            assert seq.routed_experts.shape == (len(prompt) + len(seq.tokens) - 1, layers, k)
        else:
            assert seq.routed_experts is None
    # Expert ids the trainer's expert modules receive, per layer (a pre-hook on each).
    seen: list[torch.Tensor] = []
    experts = [m for m in trainer.model.modules() if type(m).__name__.endswith("Experts")]
    hooks = [e.register_forward_pre_hook(lambda m, a: seen.append(a[1].clone())) for e in experts]
    data = [_datum(p, seq, replay=moe) for p, seq in rollouts]
    result = trainer.forward_backward(data, "importance_sampling", None, False)
    for hook in hooks:
        hook.remove()
    assert _gap(result, rollouts) < 1e-5
    if moe:  # R3: the experts used are the sampler's, per layer and position
        # the first forward replays; a second, free one (no grad) measures the gap without
        assert len(seen) == 2 * len(experts)
        seq_len = max(len(d.tokens) for d in data)
        for layer, ids in enumerate(seen[: len(experts)]):
            ids = ids.reshape(len(data), seq_len, -1)
            for row, datum in enumerate(data):
                recorded = torch.from_numpy(datum.routing[:, layer].astype(np.int64))
                assert torch.equal(ids[row, : len(recorded)], recorded)
        assert result.metrics["routing/positions:sum"] == sum(
            d.routing.shape[0] * d.routing.shape[1] for d in data
        )
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.optim_step(ADAM)
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    sampler.set_weights("inflight", trainer.sampler_weights(), 1)  # weights round-trip
    assert (
        sampler._sample_batch(
            "inflight", [SampleRequest(prompt=PROMPTS[0], num_samples=1, max_tokens=4)]
        )[0].version
        == 1
    )


def test_replay_closes_the_gap_that_a_routing_mismatch_opens():
    """The trainer's routers are perturbed so that it routes differently from the sampler: without
    replay the gap is larger than with it (the gating weights still differ); `routing/differ`
    counts the mismatch."""
    path = build_tiny_model(named_tiny_specs()[TINY_QWEN3_MOE])
    sampler = TorchSamplerEngine(path, threads=1)
    trainer = TorchTrainerEngine(path, LoraSpec(rank=0), threads=1)
    rollouts = _rollouts(sampler)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for router in moe_routers(trainer.model):
            router.weight.add_(torch.randn(router.weight.shape, generator=generator) * 0.2)
    data = [_datum(p, seq, replay=True) for p, seq in rollouts]
    metrics = trainer.forward_backward(data, "importance_sampling", None, True).metrics
    positions, differ = metrics["routing/positions:sum"], metrics["routing/differ:sum"]
    assert 0 < differ < positions
    gap_replay = metrics["routing/gap_replay:sum"] / metrics["routing/gap_tokens:sum"]
    gap_free = metrics["routing/gap_free:sum"] / metrics["routing/gap_tokens:sum"]
    assert gap_replay < gap_free, (gap_replay, gap_free)


def test_replay_is_refused_on_a_dense_model_and_lora_on_moe():
    dense = build_tiny_model(named_tiny_specs()[TINY_QWEN3_5])
    trainer = TorchTrainerEngine(dense, LoraSpec(rank=0), threads=1)
    datum = DatumArrays(
        np.arange(5, 9),
        np.arange(6, 10),
        {"weights": np.ones(4, np.float32)},
        routing=np.zeros((4, 1, 2), np.int16),
    )
    with pytest.raises(ValueError, match="routing replay needs a mixture-of-experts model"):
        trainer.forward_backward([datum], "cross_entropy", None, True)
    with pytest.raises(ValueError, match="lora_rank"):
        TorchTrainerEngine(build_tiny_model(named_tiny_specs()[TINY_QWEN3_MOE]), LoraSpec(rank=4))


def test_routing_travels_from_sample_to_trainer_datum():
    """sampler output → SDK sequence → TITO trajectory (and its JSON, as trials return it) →
    datum → engine arrays: the recorded experts arrive unchanged, covering every input position."""
    from oneloop.agents.tito import Trajectory
    from oneloop.backends.megatron_local.sample_batch import sample_response
    from oneloop.backends.megatron_local.training_client import datum_to_arrays
    from oneloop.backends.sequence_ids import routed_experts

    path = build_tiny_model(named_tiny_specs()[TINY_QWEN3_MOE])
    sampler = TorchSamplerEngine(path, threads=1)
    prompt = PROMPTS[0]
    out = sampler._sample_batch("base", [SampleRequest(prompt=prompt, num_samples=1, max_tokens=6)])
    response = sample_response(out[0].sequences, None, "run", out[0].version, 0)
    sequence = response.sequences[0]
    recorded = out[0].sequences[0].routed_experts
    assert np.array_equal(routed_experts(sequence), recorded)
    trajectory = Trajectory.start(prompt.tolist())
    trajectory = trajectory.append_sampled(sequence, prompt=trajectory.model_input())
    trajectory = Trajectory.from_json(json.loads(json.dumps(trajectory.to_json())))
    datum = trajectory.to_datum(1.0)
    inputs = {k: v for k, v in datum.loss_fn_inputs.items() if k != "weights"}  # as the loop
    datum = type(datum)(model_input=datum.model_input, loss_fn_inputs=inputs)
    arrays = datum_to_arrays(datum, "importance_sampling", 0)
    assert arrays.routing.shape[0] == len(arrays.tokens) == trajectory.length - 1
    assert np.array_equal(arrays.routing, recorded)
    assert "routed_experts" not in arrays.inputs
