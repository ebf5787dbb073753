"""Several sampler engines per base model: session-affine routing (`routing.PrefixRouter`) and the
local backend publishing every weight version to all of them (real Ray, torch engines, CPU)."""

import pickle

import numpy as np
import pytest
from tinker import types

from oneloop.backends.megatron_local.routing import PrefixRouter
from oneloop.tiny.model import TINY_MODEL_NAME
from tests.backends.local.test_local_backend import make_datum

SYSTEM = np.arange(1000, 1300)  # a 300-token system prompt every task shares


def trajectories(n: int, turns: int, seed: int = 0) -> list[list[np.ndarray]]:
    """n agent trajectories: shared system prompt + a task, each turn appending a completion and a
    tool result (10-600 tokens), so turn k's prompt extends turn k-1's."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = np.concatenate([SYSTEM, rng.integers(2000, 9000, rng.integers(20, 200))])
        chain = [prompt]
        for _ in range(turns - 1):
            prompt = np.concatenate([prompt, rng.integers(2000, 9000, rng.integers(10, 600))])
            chain.append(prompt)
        out.append(chain)
    return out


def test_a_trajectorys_turns_stay_on_one_engine_and_sessions_spread() -> None:
    router = PrefixRouter(4)
    runs = trajectories(400, 5)
    engines: list[list[int]] = [[] for _ in runs]
    # Interleaved as an async loop issues them: turn t of every trajectory, then turn t+1.
    for turn in range(5):
        for i, chain in enumerate(runs):
            engines[i].append(router.route(chain[turn]))
    assert all(len(set(e)) == 1 for e in engines)  # affinity: every turn on its first engine
    first = np.bincount([e[0] for e in engines], minlength=4) / len(runs)
    assert first.min() > 0.15 and first.max() < 0.35, first  # the shared prefix does not pin
    assert router.continued == 400 * 4 and sum(router.sessions) == 400


def test_group_samples_share_an_engine_and_copies_agree() -> None:
    router = PrefixRouter(3)
    runs = trajectories(50, 3, seed=1)
    # A copy sent to another process starts empty but routes new sessions the same way.
    copy = pickle.loads(pickle.dumps(router))
    assert copy._known == {} and copy.engines == 3
    for chain in runs:
        first = router.route(chain[0])
        assert copy.route(chain[0]) == first
        # the group's other samples repeat the first prompt, then diverge: same engine
        assert router.route(chain[0]) == first
        assert router.route(np.concatenate([chain[0], [5, 6, 7] * 30])) == first
        assert router.route(chain[1]) == first


def test_router_memory_is_bounded_and_bad_sizes_refused() -> None:
    router = PrefixRouter(2, block_tokens=16, capacity=100)
    for chain in trajectories(30, 3, seed=2):
        for prompt in chain:
            router.route(prompt)
    assert len(router._known) <= 100
    assert PrefixRouter(1).route(np.arange(500)) == 0
    with pytest.raises(ValueError, match="engines, block_tokens and capacity"):
        PrefixRouter(0)


@pytest.fixture(scope="module")
def two_sampler_service(tmp_path_factory, tiny_model_path):
    from oneloop.backends import BackendConfig, connect

    service = connect(
        BackendConfig(
            backend="local",
            run_dir=tmp_path_factory.mktemp("runs"),
            local={"torch_threads": 1, "samplers_per_model": 2},
        )
    )
    yield service
    service.close()


def prompt_for_engine(router: PrefixRouter, engine: int, seed: int) -> list[int]:
    """A fresh prompt (a new session) that the router sends to `engine`."""
    rng = np.random.default_rng(seed)
    while True:
        tokens = rng.integers(10, 1000, 80)
        if PrefixRouter(router.engines).route(tokens) == engine:
            return tokens.tolist()


def test_every_sampler_gets_each_version_and_serves_the_trainers_weights(two_sampler_service):
    import ray

    trainer = two_sampler_service.create_lora_training_client(TINY_MODEL_NAME, rank=4, seed=3)
    trainer = trainer.result()
    tokens = np.random.default_rng(0).integers(10, 1000, 40).tolist()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 39},
    )
    trainer.forward_backward([datum], "cross_entropy")
    trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    client = trainer.save_weights_and_get_sampling_client(kind="inflight").result()
    pool = client._pool
    assert len(pool.actors) == 2
    # Published to both before the client was returned (not lazily installed on first use).
    installed = [
        a.__ray_call__.remote(lambda actor, key: actor.engine.version(key), client._key)
        for a in pool.actors
    ]
    assert ray.get(installed, timeout=60) == [client.version, client.version]
    for engine in (0, 1):
        prompt = prompt_for_engine(pool.router, engine, seed=engine)
        sampled = client.sample(
            types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=12, seed=4)
        ).result(timeout=120)
        data = [make_datum(prompt + s.tokens) for s in sampled.sequences]
        out = trainer.forward(data, "cross_entropy").result()
        for seq, lp in zip(sampled.sequences, out.loss_fn_outputs, strict=True):
            trainer_lp = lp["logprobs"].to_numpy()[len(prompt) - 1 :]
            np.testing.assert_allclose(trainer_lp, seq.logprobs, atol=1e-5)  # new weights here
    assert pool.router.sessions == [1, 1]  # one request was routed to each engine
    # A crash of one sampler: its requests re-install this client's weights there and go on.
    ray.kill(pool.actors[1], no_restart=False)
    again = client.compute_logprobs(
        types.ModelInput.from_ints(prompt_for_engine(pool.router, 1, seed=1))
    ).result(timeout=300)
    assert np.isfinite(np.asarray(again[1:], dtype=float)).all()
