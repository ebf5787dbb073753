"""The protobuf codec of `oneloop serve`: request bodies in, result bodies out (no routes, no
storage: `serve/app.py` routes, `serve/wire.py` holds the JSON wire models).

Decoding a `/forward_backward` body, two paths with the same answers:
- fast path (`fast_*`): `fast_scan` reads the datums' bytes itself, straight into the trainer
  engine's `DatumArrays` (`decode_request` is the entry point: fast path first, reference path
  when it declines); `fast_ragged` checks the framing of datums of different lengths at once;
  `fast_batch` holds the joined arrays and makes per-datum views only when read.
- reference path (`reference*`): `reference` parses with the generated message class into
  `tinker.types` (`decode_forward_backward`, `check_header` shared with the fast path);
  `reference_datums` decodes the datums in batched buffers (`TokenIds`); `reference_types`
  builds the `tinker.types` objects without re-validating what was checked.

Encoding results:
- `forward_backward_encoder`: `ForwardBackwardOutput` -> protobuf bytes.
- `sample_encoder`: `SampleResponse` -> protobuf bytes (batched, joined, or the generated class).
- `sample_versions`: the weight versions a sample response ran on (the `asample` ack).
"""
