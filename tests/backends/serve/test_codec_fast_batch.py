"""The fast decoder's datums (`codec.fast_batch`): `DatumArrays` whose fields are read from the
batch's joined arrays, and which cross a pickle (Ray's way to the trainer actor) as the joined
arrays once, arriving as plain `DatumArrays` equal to the reference decoder's."""

import pickle

import numpy as np
import pytest
import ray
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from oneloop.backends.megatron_local.engines.base import DatumArrays
from oneloop.backends.megatron_local.serve.codec import reference
from oneloop.backends.megatron_local.serve.codec.fast_batch import BatchDatum, DatumList
from oneloop.backends.megatron_local.serve.codec.fast_scan import scan_forward_backward
from oneloop.backends.megatron_local.training_client import datum_to_arrays


def _body(lengths: list[int], loss: str = "cross_entropy") -> bytes:
    rng = np.random.default_rng(len(lengths))
    data = []
    for n in lengths:
        ids = rng.integers(0, 1000, n + 1)
        inputs = {"target_tokens": ids[1:].astype(np.int64)}
        if loss == "importance_sampling":
            inputs |= {"logprobs": -rng.random(n, np.float32),
                       "advantages": rng.random(n, np.float32)}  # fmt: skip
        else:
            inputs["weights"] = rng.random(n, np.float32)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1].tolist()),
                                loss_fn_inputs=inputs))  # fmt: skip
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss),
        model_id="m", seq_id=1,
    )  # fmt: skip
    return forward_backward_request_to_proto(request).SerializeToString()


def _reference(body: bytes) -> list[DatumArrays]:
    fb = reference.decode_forward_backward(body).input
    return [datum_to_arrays(d, fb.loss_fn, i) for i, d in enumerate(fb.data)]


def _assert_equal(got: list[DatumArrays], want: list[DatumArrays]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.tokens.dtype == b.tokens.dtype and a.tokens.tolist() == b.tokens.tolist()
        assert a.targets.dtype == b.targets.dtype and a.targets.tolist() == b.targets.tolist()
        assert a.inputs.keys() == b.inputs.keys()
        for key, value in a.inputs.items():
            assert value.dtype == b.inputs[key].dtype
            assert value.tobytes() == b.inputs[key].tobytes()


LAYOUTS = {
    "uniform": ([64] * 12, "cross_entropy"),
    "ragged_batch": ([5, 70, 33, 1, 128, 9, 64, 12, 40], "importance_sampling"),
    "ragged_one_by_one": ([7, 3, 19], "cross_entropy"),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_datums_read_like_the_reference_and_unpickle_as_plain_datums(layout):
    lengths, loss = LAYOUTS[layout]
    body = _body(lengths, loss)
    scanned = scan_forward_backward(body)
    assert scanned is not None
    arrays = scanned.arrays
    assert type(arrays) is DatumList and all(type(d) is BatchDatum for d in arrays)
    assert all(isinstance(d, DatumArrays) for d in arrays)
    want = _reference(body)
    _assert_equal(arrays, want)
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(arrays, protocol=5, buffer_callback=buffers.append)
    fields = 2 + len(want[0].inputs)
    # the joined arrays (and the lengths), once, not one per datum and field
    assert len(buffers) <= fields + 1 < fields * len(want)
    back = pickle.loads(data, buffers=buffers)
    assert type(back) is list and all(type(d) is DatumArrays for d in back)
    _assert_equal(back, want)


def test_a_changed_list_or_one_datum_pickles_item_by_item():
    body = _body([5, 70, 33, 1, 128, 9, 64, 12, 40])
    arrays = scan_forward_backward(body).arrays
    want = _reference(body)
    arrays.reverse()
    back = pickle.loads(pickle.dumps(arrays))
    assert type(back) is list and all(type(d) is DatumArrays for d in back)
    _assert_equal(back, want[::-1])
    single = pickle.loads(pickle.dumps(arrays[0]))
    assert type(single) is DatumArrays
    _assert_equal([single], [want[-1]])


def test_ray_delivers_plain_datums():
    """Through the real object store (as the trainer actor's argument travels)."""
    body = _body([5, 70, 33, 1, 128, 9, 64, 12, 40])
    arrays = scan_forward_backward(body).arrays
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote
        def kinds(data: list[DatumArrays]) -> tuple[str, list[str], list[list[int]]]:
            return (
                type(data).__name__,
                [type(d).__name__ for d in data],
                [d.tokens.tolist() for d in data],
            )

        outer, inner, tokens = ray.get(kinds.remote(arrays), timeout=300)
    finally:
        if started:
            ray.shutdown()
    assert outer == "list" and set(inner) == {"DatumArrays"}
    assert tokens == [d.tokens.tolist() for d in _reference(body)]
