"""The fast `/forward_backward` decoder (`codec.fast_scan`) against the reference path
(`reference.decode_forward_backward`, then the local client's `datum_to_arrays`): the same engine
arrays on random and edge-case bodies, None (the reference answers) for anything else, and a
malformed body still gets a 4xx that names the field."""

import math

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from oneloop.backends import BackendConfig, connect
from oneloop.backends.megatron_local.losses import REQUIRED_INPUTS
from oneloop.backends.megatron_local.serve import ServeConfig, ServerThread
from oneloop.backends.megatron_local.serve.codec import fast_batch, fast_scan
from oneloop.backends.megatron_local.serve.codec.fast_scan import (
    decode_request,
    scan_forward_backward,
)
from oneloop.backends.megatron_local.serve.codec.reference import (
    DecodedForwardBackward,
    decode_forward_backward,
)
from oneloop.backends.megatron_local.training_client import datum_to_arrays
from oneloop.errors import WireError

LOSSES = sorted(REQUIRED_INPUTS)


def _datum(chunks: list[list[int]], inputs: dict[str, np.ndarray]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=c) for c in chunks]),
        loss_fn_inputs={k: types.TensorData.from_numpy(v) for k, v in inputs.items()},
    )


def _body(data, loss_fn="cross_entropy", config=None, forward_only=False) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn=loss_fn, loss_fn_config=config
        ),
        model_id="s:train:0",
        seq_id=7,
    )
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def _reference_arrays(body: bytes):
    """What the server made before the fast path: the decoded request and its engine arrays
    (an exception where either step refuses the body)."""
    decoded = decode_forward_backward(body)
    fb = decoded.input
    return decoded, [datum_to_arrays(d, fb.loss_fn, i) for i, d in enumerate(fb.data)]


def _assert_same(scanned, body: bytes) -> None:
    decoded, arrays = _reference_arrays(body)
    assert (scanned.model_id, scanned.seq_id, scanned.forward_only) == (
        decoded.model_id, decoded.seq_id, decoded.forward_only)  # fmt: skip
    assert scanned.loss_fn == decoded.input.loss_fn
    assert scanned.loss_fn_config == decoded.input.loss_fn_config
    assert scanned.num_tokens == decoded.num_tokens
    assert len(scanned.arrays) == len(arrays)
    for got, want in zip(scanned.arrays, arrays, strict=True):
        for a, b in ((got.tokens, want.tokens), (got.targets, want.targets)):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
        assert got.inputs.keys() == want.inputs.keys()
        for key, value in got.inputs.items():
            assert value.dtype == want.inputs[key].dtype and value.shape == want.inputs[key].shape
            assert value.tobytes() == want.inputs[key].tobytes()  # bit for bit (NaN-free)
            assert value.flags.writeable and value.flags.c_contiguous


finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@st.composite
def batches(draw):
    """A valid request body: random loss, datum count, lengths (all equal or ragged), chunking,
    and values, including the extremes of each dtype."""
    loss = draw(st.sampled_from(LOSSES))
    n = draw(st.integers(1, 6))
    if draw(st.booleans()):
        lengths = [draw(st.integers(1, 40))] * n
    else:
        lengths = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    data = []
    for length in lengths:
        ids = draw(st.lists(st.integers(0, 2**31 - 1), min_size=length, max_size=length))
        cuts = sorted(draw(st.sets(st.integers(1, max(1, length - 1)), max_size=2)))
        chunks = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, length], strict=True)]
        chunks = [c for c in chunks if c]
        targets = draw(st.lists(st.integers(0, 2**63 - 1), min_size=length, max_size=length))
        inputs = {"target_tokens": np.array(targets, np.int64)}
        for name in REQUIRED_INPUTS[loss]:
            values = draw(st.lists(finite_f32, min_size=length, max_size=length))
            if name == "sequence_ratio_mask" and not any(values):
                values[0] = 1.0  # gspo: an all-zero mask is invalid (losses.validate_datum_inputs)
            inputs[name] = np.array(values, np.float32)
        data.append(_datum(chunks, inputs))
    config = {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5} if loss == "ppo" else None
    return _body(data, loss, config, forward_only=draw(st.booleans()))


@settings(max_examples=150, deadline=None)
@given(body=batches())
def test_fast_path_gives_the_reference_arrays(body):
    scanned = scan_forward_backward(body)
    assert scanned is not None
    _assert_same(scanned, body)


@st.composite
def mutated(draw):
    body = bytearray(draw(batches()))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(body) - 1))
        how = draw(st.sampled_from(["set", "delete", "insert", "truncate"]))
        if how == "set":
            body[at] = draw(st.integers(0, 255))
        elif how == "delete":
            del body[at : at + draw(st.integers(1, 4))]
        elif how == "insert":
            body[at:at] = draw(st.binary(min_size=1, max_size=4))
        else:
            del body[at:]
        if not body:
            break
    return bytes(body)


@settings(max_examples=400, deadline=None)
@given(body=mutated())
def test_a_body_the_fast_path_takes_is_one_the_reference_takes_alike(body):
    """Broken bodies: the fast path takes one only when the reference path accepts it and
    makes the same arrays; whatever it declines, `decode_request` answers as the reference."""
    _assert_like_reference(body)


def _assert_like_reference(body: bytes) -> None:
    """The fast path takes `body` only when the reference accepts it and makes the same arrays;
    whatever it declines, `decode_request` answers as the reference (same arrays or same error)."""
    scanned = scan_forward_backward(body)
    if scanned is not None:
        _assert_same(scanned, body)
        return
    try:
        want = decode_forward_backward(body)
    except WireError as error:
        with pytest.raises(WireError) as info:
            decode_request(body)
        assert (str(info.value), info.value.status) == (str(error), error.status)
    else:
        _assert_same_decoded(decode_request(body), want)


def _assert_same_decoded(got, want) -> None:
    """`got` is the reference decoder's answer: equal to `want`, datum by datum."""
    assert isinstance(got, DecodedForwardBackward)
    assert (got.model_id, got.seq_id, got.forward_only, got.num_tokens) == (
        want.model_id, want.seq_id, want.forward_only, want.num_tokens)  # fmt: skip
    assert (got.input.loss_fn, got.input.loss_fn_config) == (
        want.input.loss_fn, want.input.loss_fn_config)  # fmt: skip
    for a, b in zip(got.input.data, want.input.data, strict=True):
        assert a.model_input.to_ints() == b.model_input.to_ints()
        assert a.loss_fn_inputs.keys() == b.loss_fn_inputs.keys()
        for key, value in a.loss_fn_inputs.items():
            assert value.to_numpy().tobytes() == b.loss_fn_inputs[key].to_numpy().tobytes()


def _ce(tokens: list[int], weights=None, targets=None) -> types.Datum:
    n = len(tokens)
    return _datum([tokens], {
        "target_tokens": np.array(targets if targets is not None else tokens, np.int64),
        "weights": np.array(weights if weights is not None else [1.0] * n, np.float32),
    })  # fmt: skip


def _pb_datum(body_datum: types.Datum) -> pb.Datum:
    return pb.ForwardBackwardRequest.FromString(_body([body_datum])).data[0]


def _with_datum(msg_datum: bytes, count: int = 2) -> bytes:
    """A request whose `data` is `count` copies of the given serialized datum."""
    head = pb.ForwardBackwardRequest(model_id="s:train:0", seq_id=7, loss_fn="cross_entropy")
    record = b"\x1a" + _varint(len(msg_datum)) + msg_datum
    return head.SerializeToString() + record * count


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes([*out, value])


def _entry(name: str, tensor: pb.Tensor) -> bytes:
    body = pb.Datum.LossFnInputsEntry(key=name, value=tensor).SerializeToString()
    return b"\x12" + _varint(len(body)) + body


def test_entries_in_another_order_and_a_uniform_batch_take_the_fast_path():
    datum = _pb_datum(_ce([3, 4, 5], [0.5, -1.0, 2.0]))
    chunk = datum.model_input[0].SerializeToString()
    reordered = (b"\x0a" + _varint(len(chunk)) + chunk
                 + _entry("weights", datum.loss_fn_inputs["weights"])
                 + _entry("target_tokens", datum.loss_fn_inputs["target_tokens"]))  # fmt: skip
    for body in (_with_datum(reordered, 3), _body([_ce([1, 2])] * 5), _body([_ce([9])])):
        scanned = scan_forward_backward(body)
        assert scanned is not None
        _assert_same(scanned, body)


def _declined(datum_bytes: bytes) -> bytes:
    """A two-datum body of a valid datum and `datum_bytes`."""
    good = _pb_datum(_ce([1, 2, 3])).SerializeToString()
    head = pb.ForwardBackwardRequest(model_id="s:train:0", seq_id=7, loss_fn="cross_entropy")
    return head.SerializeToString() + b"".join(
        b"\x1a" + _varint(len(d)) + d for d in (good, datum_bytes)
    )


def _add_spans(datum: pb.Datum) -> None:
    for spans in (datum.model_input_spans, datum.loss_fn_input_spans):
        span = spans.add().prompt_tokens
        span.sequence_id, span.length = "s", 3


def _mutate(change) -> bytes:
    datum = _pb_datum(_ce([1, 2, 3]))
    change(datum)
    return _declined(datum.SerializeToString())


@pytest.mark.parametrize(
    "body",
    [
        # the reference accepts these; the fast path leaves them to it
        _body([_datum([[1, 2]], {"target_tokens": np.array([1, 2]), "weights": np.array([1, 2])})]),
        _mutate(lambda d: d.model_input.add().encoded_text.SetInParent()),  # an empty chunk
        _mutate(_add_spans),
        _declined(_pb_datum(_ce([1, 2, 3])).SerializeToString() + b"\x28\x01"),  # unknown field
        _mutate(lambda d: d.loss_fn_inputs["weights"].ClearField("shape")),
    ],
)
def test_other_valid_forms_get_the_reference_answer(body):
    decoded, _ = _reference_arrays(body)
    result = decode_request(body)
    if scan_forward_backward(body) is None:
        _assert_same_decoded(result, decoded)
    else:
        _assert_same(result, body)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            _body([_ce([1, 2]), _ce([1, -5, 3])]),
            "data[1].model_input[0].tokens: token ids must be >= 0",
        ),
        (
            _body([_ce([1, 2]), _ce([1, 2], [1.0, math.nan])]),
            "data[1].loss_fn_inputs['weights']: values must be finite",
        ),
        (
            _body([_ce([1, 2])] * 3 + [_ce([1, 2], [1.0, math.inf])]),
            "data[3].loss_fn_inputs['weights']: values must be finite",
        ),
        (
            _mutate(lambda d: setattr(d.loss_fn_inputs["weights"], "dense", b"abc")),
            "data[1].loss_fn_inputs['weights'].dense: byte length is not a multiple of 4",
        ),
        (
            _mutate(lambda d: d.loss_fn_inputs["weights"].shape.append(9)),
            "data[1].loss_fn_inputs['weights']: shape [3, 9] needs 27 values, got 3",
        ),
        (_body([_ce([1, 2])])[:-3], "body: not a ForwardBackwardRequest protobuf"),
        # an enum value the schema does not name (was a ValueError, so a 500)
        (
            _mutate(lambda d: setattr(d.loss_fn_inputs["weights"], "dtype", 5)),
            "data[1].loss_fn_inputs['weights'].dtype: must be FLOAT32 or INT64, got 5",
        ),
    ],
)
def test_malformed_bodies_raise_the_reference_error(body, message):
    assert scan_forward_backward(body) is None
    with pytest.raises(WireError) as info:
        decode_request(body)
    assert str(info.value).startswith(message) and info.value.status == 400


@pytest.mark.parametrize(
    "datum",
    [
        _ce([1, 2, 3], targets=[1, -2, 3]),  # a negative target
        _ce([1, 2, 3], weights=[1.0, 1.0]),  # weights shorter than the model input
        _datum([[1, 2]], {"target_tokens": np.array([1, 2])}),  # no weights
        _datum(
            [[1, 2]],
            {
                "target_tokens": np.array([1, 2]),
                "weights": np.ones(2, np.float32),
                "advantages": np.ones(2, np.float32),
            },
        ),  # an input the loss refuses
    ],
)
def test_datums_the_loss_refuses_are_left_to_the_reference_check(datum):
    body = _body([_ce([1, 2, 3]), datum])
    assert scan_forward_backward(body) is None
    with pytest.raises(ValueError, match="datum 1: "):
        _reference_arrays(body)


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    backend = connect(BackendConfig(backend="local", run_dir=tmp_path_factory.mktemp("scan"),
                                    local={"torch_threads": 1}))  # fmt: skip
    with ServerThread(ServeConfig(port=0, long_poll_s=1.0), backend) as thread:
        with httpx.Client(base_url=f"{thread.base_url}/api/v1", timeout=60) as client:
            yield client
    backend.close()


PROTOBUF = {"content-type": "application/x-protobuf"}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (_body([_ce([1, 2]), _ce([4, -1])]), "data[1].model_input[0].tokens"),
        (
            _body([_ce([1, 2])] * 4 + [_ce([1, 2], [0.0, math.nan])]),
            "data[4].loss_fn_inputs['weights']",
        ),
        (
            _mutate(lambda d: d.loss_fn_inputs["weights"].shape.append(9)),
            "data[1].loss_fn_inputs['weights']",
        ),
        (  # regression: an unnamed enum value was a ValueError in the decoder, so a 500
            _mutate(lambda d: setattr(d.loss_fn_inputs["weights"], "dtype", 7)),
            "data[1].loss_fn_inputs['weights'].dtype",
        ),
    ],
)
def test_malformed_protobuf_gets_400_naming_the_field(http, body, field):
    r = http.post("/forward_backward", content=body, headers=PROTOBUF)
    assert r.status_code == 400 and field in r.json()["detail"], r.text


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(body=mutated())
def test_broken_protobuf_gets_4xx(http, body):
    r = http.post("/forward_backward", content=body, headers=PROTOBUF)
    assert 400 <= r.status_code < 500, (body, r.status_code, r.text)


@pytest.mark.parametrize(
    "lengths",
    [
        [1, 15, 16, 17, 31, 32, 33],  # 4 T and 8 T cross a one-byte varint
        [2047, 2048, 2049, 1, 5000],  # datum and tensor lengths cross two-byte varints
        [3, 3, 4, 3],  # equal widths in part
    ],
)
def test_ragged_batches_are_checked_at_once_and_match_the_reference(lengths):
    rng = np.random.default_rng(len(lengths))
    lengths = lengths * (fast_scan.RAGGED_BATCH_MIN_DATUMS // len(lengths) + 1)
    data = [
        _ce(rng.integers(0, 2**31 - 1, n).tolist(), rng.standard_normal(n).tolist())
        for n in lengths
    ]
    body = _body(data)
    header, records = fast_scan._split(body)
    layout = fast_scan._read_datum(body, records.payloads[0], records.ends[0])
    assert fast_scan._ragged_batch(body, records, layout) is not None  # no datum-by-datum read
    scanned = scan_forward_backward(body)
    assert scanned is not None
    _assert_same(scanned, body)


def test_a_datum_framed_otherwise_in_a_ragged_batch_is_read_on_its_own():
    """One datum with its entries in the other order: the batch check declines, the
    datum-by-datum reader takes the batch, and the arrays are still the reference's."""
    good = [_pb_datum(_ce(list(range(n)))).SerializeToString() for n in (2, 7)]
    first = fast_scan._read_datum(good[0], 0, len(good[0]))[1][0][0].decode()
    datum = _pb_datum(_ce([3, 4, 5, 6], [0.5, -1.0, 2.0, 0.0]))
    chunk = datum.model_input[0].SerializeToString()
    order = (
        ["weights", "target_tokens"] if first == "target_tokens" else ["target_tokens", "weights"]
    )
    reordered = (b"\x0a" + _varint(len(chunk)) + chunk
                 + b"".join(_entry(n, datum.loss_fn_inputs[n]) for n in order))  # fmt: skip
    head = pb.ForwardBackwardRequest(model_id="s:train:0", seq_id=7, loss_fn="cross_entropy")
    many = good * (fast_scan.RAGGED_BATCH_MIN_DATUMS // 2)
    body = head.SerializeToString() + b"".join(
        b"\x1a" + _varint(len(d)) + d for d in (*many, reordered, *many)
    )
    header, records = fast_scan._split(body)
    layout = fast_scan._read_datum(body, records.payloads[0], records.ends[0])
    assert fast_scan._ragged_batch(body, records, layout) is None
    scanned = scan_forward_backward(body)
    assert scanned is not None
    _assert_same(scanned, body)


@st.composite
def large_ragged_bodies(draw):
    """Enough datums for the batch check (`fast_scan.RAGGED_BATCH_MIN_DATUMS`), random lengths
    and values, the loss's inputs; at times one byte changed anywhere."""
    loss = draw(st.sampled_from(LOSSES))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    count = fast_scan.RAGGED_BATCH_MIN_DATUMS + draw(st.integers(0, 20))
    top = draw(st.sampled_from([3, 40, 300]))
    data = []
    for length in rng.integers(1, top + 1, count):
        inputs = {"target_tokens": rng.integers(0, 2**62, length)}
        for name in REQUIRED_INPUTS[loss]:
            inputs[name] = rng.standard_normal(length).astype(np.float32)
        data.append(_datum([rng.integers(0, 2**31 - 1, length).tolist()], inputs))
    body = bytearray(_body(data, loss))
    if draw(st.booleans()):
        at = draw(st.integers(0, len(body) - 1))
        body[at] = draw(st.integers(0, 255))
    return bytes(body)


@settings(max_examples=60, deadline=None)
@given(body=large_ragged_bodies())
def test_large_ragged_batches_match_the_reference(body):
    _assert_like_reference(body)


def test_datum_arrays_of_a_single_flat_datum():
    """`fast_batch.datum_arrays` on flat (ragged-layout) arrays of one datum: one DatumArrays
    holding the whole arrays (itemgetter of one slice returns the item itself, not a tuple)."""
    tokens = np.arange(3, dtype=np.int64)
    fields = {b"target_tokens": np.arange(1, 4, dtype=np.int64),
              b"weights": np.ones(3, np.float32)}  # fmt: skip
    (datum,) = fast_batch.datum_arrays(tokens, fields, np.array([3]))
    assert datum.tokens.tolist() == [0, 1, 2] and datum.targets.tolist() == [1, 2, 3]
    assert list(datum.inputs) == ["weights"] and datum.inputs["weights"].tolist() == [1.0] * 3
