"""JSON wire models of `oneloop serve`: strict parsing with errors that name the field."""

import json

import pytest
from tinker import types

from oneloop.backends.megatron_local.serve.wire import (
    FinishSessionRequest,
    check_checkpoint_id,
    check_run_id,
    client_config,
    parse_json,
    parse_sample_request,
    sampling_session_id,
    session_of,
    training_model_id,
    try_again_body,
)
from oneloop.errors import WireError


def test_sdk_request_types_reject_unknown_keys_naming_them():
    body = b'{"session_id": "s", "type": "session_heartbeat", "surprise": 1}'
    with pytest.raises(WireError, match="surprise") as info:
        parse_json(types.SessionHeartbeatRequest, body)
    assert info.value.status == 400


def test_missing_and_mistyped_fields_are_named():
    with pytest.raises(WireError, match="model_seq_id"):
        parse_json(types.CreateModelRequest, {"session_id": "s", "base_model": "m"})
    with pytest.raises(WireError, match="reason.type"):
        parse_json(FinishSessionRequest, b'{"reason": {"type": "exploded"}}')
    with pytest.raises(WireError, match="body"):
        parse_json(types.CreateSessionRequest, b"\xff not json")


def test_adam_params_arrive_under_their_wire_name():
    req = parse_json(
        types.OptimStepRequest,
        {"adam_params": {"learning_rate": 0.5}, "model_id": "m", "seq_id": 1},
    )
    assert isinstance(req.optim_params, types.AdamParams)
    assert req.optim_params.learning_rate == 0.5


def _sample_body(**params):
    return json.dumps(
        {
            "prompt": {"chunks": [{"tokens": [1], "type": "encoded_text"}]},
            "sampling_params": params,
            "sampling_session_id": "s:sample:0",
            "seq_id": 0,
            "type": "sample",
        }
    ).encode()


def test_sampling_params_are_strict():
    ok = parse_sample_request(_sample_body(max_tokens=3, stop=[1, 2], temperature=0.5))
    assert ok.sampling_params.max_tokens == 3 and ok.sampling_params.stop == [1, 2]
    with pytest.raises(WireError, match="sampling_params.beam"):
        parse_sample_request(_sample_body(max_tokens=1, beam=4))
    for bad in ({"max_tokens": 0}, {"top_p": 0.0}, {"temperature": -1.0}, {"top_k": -5}):
        with pytest.raises(WireError, match=f"sampling_params.{next(iter(bad))}"):
            parse_sample_request(_sample_body(**bad))
    with pytest.raises(WireError, match="JSON object"):
        parse_sample_request(b"[1, 2]")


def test_ids_and_checkpoint_names():
    assert training_model_id("sess-1", 3) == "sess-1:train:3"
    assert sampling_session_id("sess-1", 0) == "sess-1:sample:0"
    assert session_of("sess-1:train:3") == session_of("sess-1:sample:9") == "sess-1"
    assert check_checkpoint_id("weights/step-1", "c") == ("weights", "step-1")
    assert check_run_id("run-abc", "r") == "run-abc"
    for bad in ("weights/../x", "weights/a/b", "other/x", "weights/", "sampler_weights/.."):
        with pytest.raises(WireError, match="checkpoint_id"):
            check_checkpoint_id(bad, "checkpoint_id")
    for bad in ("..", "a/b", "", "/etc"):
        with pytest.raises(WireError, match="training_run_id"):
            check_run_id(bad, "training_run_id")


def test_protocol_bodies():
    assert try_again_body("req-1") == {
        "type": "try_again",
        "request_id": "req-1",
        "queue_state": "active",
    }
    flags = client_config(compress_fwdbwd=True, use_pyqwest=False)
    assert flags.pjwt_auth_enabled is False and flags.proto_compress_fwdbwd is True
    assert flags.sample_use_retrieve_futures is False and flags.fwdbwd_max_chunk_len == 1024
