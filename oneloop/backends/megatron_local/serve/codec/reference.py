"""The reference decoder of a `/forward_backward` body: the generated protobuf class, then
`tinker.types` (the server side of the codec; the SDK ships the schema as
`tinker.proto.tinker_public_pb2`, package `tinker_public`, and only the client halves,
`request_conv.forward_backward_request_to_proto` and `response_conv.deserialize_*`).

- `decode_forward_backward(body)`: a `ForwardBackwardRequest` message -> `DecodedForwardBackward`
  (model id, seq id, `forward_only`, and a `tinker.types.ForwardBackwardInput`): the reference
  path, taken for the bodies the fast path (`codec.fast_scan`, straight to engine arrays) does
  not take. The datums are decoded by `codec.reference_datums.decode_data` (batched buffers;
  token chunks hold `TokenIds`, no Python int per token). `loss_fn_config_v2` (number | text)
  supersedes the legacy float-only `loss_fn_config` map when set; the SDK never sends `seq_id` 0
  for forward_backward (it uses request id + 1).
- `check_header(msg, has_data)`: the request's fields other than the datums, shared with the
  fast path so both read them the same way.

The encoders of the results are `codec.forward_backward_encoder` and `codec.sample_encoder`.
Every malformed input raises `WireError` (400) naming the offending field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, get_args

from google.protobuf.message import DecodeError
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from oneloop.backends.megatron_local.serve.codec.reference_datums import decode_data
from oneloop.errors import WireError

# `custom` needs a loss uploaded through create_custom_loss, which this server does not offer.
LOSS_FNS: frozenset[str] = frozenset(get_args(types.LossFnType)) - {"custom"}


@dataclass(frozen=True)
class DecodedForwardBackward:
    """A decoded `/forward_backward` body."""

    model_id: str
    seq_id: int
    forward_only: bool
    input: types.ForwardBackwardInput
    num_tokens: int

    def submit(self, client: Any) -> Any:
        """Start the call on a training client (`forward` or `forward_backward`)."""
        fb = self.input
        call = client.forward if self.forward_only else client.forward_backward
        return call(fb.data, fb.loss_fn, fb.loss_fn_config)


def decode_forward_backward(body: bytes) -> DecodedForwardBackward:
    """Parse and validate a `ForwardBackwardRequest` protobuf (the reference path: `fast_scan`
    decodes the usual bodies straight into engine arrays and falls back to this one)."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise WireError(f"body: not a ForwardBackwardRequest protobuf ({e})") from e
    config = check_header(msg, has_data=bool(msg.data))
    data, num_tokens = decode_data(msg.data)
    return DecodedForwardBackward(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        forward_only=msg.forward_only,
        input=types.ForwardBackwardInput(
            data=data, loss_fn=msg.loss_fn, loss_fn_config=config or None  # type: ignore[arg-type]
        ),
        num_tokens=num_tokens,
    )


def check_header(msg: pb.ForwardBackwardRequest, has_data: bool) -> dict[str, float | str]:
    """Check a request's fields other than the datums; its loss config (empty when none)."""
    if not msg.model_id:
        raise WireError("model_id: required")
    if msg.seq_id < 0:
        raise WireError(f"seq_id: must be >= 0, got {msg.seq_id}")
    if msg.loss_fn not in LOSS_FNS:
        raise WireError(f"loss_fn: must be one of {sorted(LOSS_FNS)}, got {msg.loss_fn!r}")
    if not has_data:
        raise WireError("data: at least one datum is required")
    config: dict[str, float | str] = {}
    if msg.loss_fn_config_v2:
        for key, value in msg.loss_fn_config_v2.items():
            which = value.WhichOneof("value")
            if which is None:
                raise WireError(f"loss_fn_config_v2[{key!r}]: needs a number or a text value")
            config[key] = value.text if which == "text" else value.number
    else:
        config.update(msg.loss_fn_config.items())
    for key, value in config.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise WireError(f"loss_fn_config[{key!r}]: must be finite, got {value}")
    return config
