"""Encoding a `SampleResponse` result the way `response_conv.deserialize_sample_response` reads it.

Wire facts: tokens int32, logprobs float32, prompt logprobs float32 with NaN for "not
computed"; top-k as dense `(length, k)` matrices with the sentinel (token 0, logprob -99999.0)
for empty cells. `sequence_id` is not on the wire: the SDK stamps the ids from the asample
acknowledgement (`sample_sequence_ids`) onto the sequences.

Three encoders, byte for byte the same output:
- `_encode_batch`, for a response made by the local sampling client, whose `sequences` is a
  `sample_batch.SampledSequences`: it reads the batch (all tokens in one int32 array, all
  logprobs in one float32 array, lengths, stop reasons), never the SDK objects. Sequences of one
  length and stop reason fill a cached template of the whole response's framing with two numpy
  copies (64 x 32 tokens: ~5 us); others join per-sequence framing with slices of the two
  arrays.
- `_encode_joined`, for the usual response (every sequence holds numpy int32 tokens, all or none
  hold float32 logprobs, no top-k): each sequence's framing bytes (tag, length, stop reason, the
  tokens' tag and length; cached per (length, stop reason)) are joined with the arrays' own
  buffers in one `bytes.join`, so a sequence costs a few C-level steps and no Python loop body:
  the fields of all sequences are read into one flat list and split by slicing, the join's
  list is filled by slice assignment, and a response whose sequences share a length and stop
  reason looks its framing up once. A 64 x 32-token response (~30 us, thread CPU) is bound by
  the per-sequence reads: 5 fields, 2 dtypes and 2 sizes (~10 + 6 + 5 us for 64 sequences)
  and the join's buffer requests (~5 us); no per-sequence Python object can be skipped, so
  ~10 us (200 M tokens/s at 64 x 32) is out of reach on this path.
- the generated message class, for everything else; it also names a bad field.
The message's other fields (prompt logprobs, top-k, cache hits) follow as a second
generated-class serialization (fields 2-4 after the sequences, as the class itself orders them).
The numpy fields (`tokens_np`, `logprobs_np`, `prompt_logprobs_np`) are used when present, so the
SDK's lazy Python lists are never built.
"""

from __future__ import annotations

import dataclasses
import math
from itertools import chain
from operator import attrgetter, itemgetter

import numpy as np
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.types.topk_logprobs import MASK_LOGPROB, TopkLogprobs

from oneloop.backends.megatron_local.sample_batch import SampledBatch, SampledSequences
from oneloop.backends.megatron_local.serve.codec.fast_ragged import encode_varint

STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
_INT32, _FLOAT32 = np.dtype(np.int32), np.dtype(np.float32)
# The fields the joined encoder reads, `SampledSequence` being tinker 0.38's frozen dataclass
# (the private list fields are read directly: the public properties would build and cache them).
_FIELDS = ("tokens_np", "logprobs_np", "stop_reason", "topk_logprobs_np", "_topk_logprobs_list")
_KNOWN = {f.name for f in dataclasses.fields(types.SampledSequence)} >= {*_FIELDS, "_logprobs_list"}
_read_fields = attrgetter(*_FIELDS)
_read_logprobs_list = attrgetter("_logprobs_list")
_dtype, _size = attrgetter("dtype"), attrgetter("size")
# The response's fields other than `sequences`; a response with these values has nothing more
# on the wire (the generated class leaves out a zero and an unset field).
_REST_FIELDS = ("prompt_logprobs_np", "_prompt_logprobs_list", "topk_prompt_logprobs_np",
                "_topk_prompt_logprobs_list", "prompt_cache_hit_tokens")  # fmt: skip
_KNOWN_REST = {f.name for f in dataclasses.fields(types.SampleResponse)} >= set(_REST_FIELDS)
_read_rest = attrgetter(*_REST_FIELDS)
_first, _second = itemgetter(0), itemgetter(1)
# Below this many sequences the joined encoder's fixed cost (~5 us) outweighs what it saves over
# the generated class (measured: 1 sequence 5.6 us vs 2.7 us, 4: 7.5 vs 7.0, 6: 8.7 vs 9.6,
# 64 x 32 tokens: 43 us vs 87 us).
JOIN_MIN_SEQUENCES = 5


def encode_sample_response(resp: types.SampleResponse) -> bytes:
    """Serialize a `SampleResponse` the way `response_conv.deserialize_sample_response` reads it."""
    if type(resp.sequences) is SampledSequences:
        return _encode_batch(resp, resp.sequences.batch)
    joined = _encode_joined(resp) if _KNOWN and len(resp.sequences) >= JOIN_MIN_SEQUENCES else None
    if joined is not None:
        return joined
    msg = _rest(resp)
    for i, seq in enumerate(resp.sequences):
        if seq.stop_reason not in STOP_REASONS:
            raise ValueError(f"sequences[{i}].stop_reason: unknown {seq.stop_reason!r}")
        out = msg.sequences.add(stop_reason=STOP_REASONS[seq.stop_reason])
        tokens = seq.tokens_np if seq.tokens_np is not None else seq.tokens
        out.tokens = np.ascontiguousarray(tokens, dtype=np.int32).tobytes()
        logprobs = seq.logprobs_np if seq.logprobs_np is not None else seq.logprobs
        if logprobs is not None:
            out.logprobs = np.ascontiguousarray(logprobs, dtype=np.float32).tobytes()
        if seq.topk_logprobs is not None:
            _fill_topk(out.topk_sampled_logprobs,
                       _as_topk(seq.topk_logprobs_np, seq.topk_logprobs))  # fmt: skip
    return msg.SerializeToString()


def _rest(resp: types.SampleResponse) -> pb.SampleResponse:
    """The message's fields other than `sequences`."""
    msg = pb.SampleResponse(prompt_cache_hit_tokens=int(resp.prompt_cache_hit_tokens))
    if resp.prompt_logprobs_np is not None:  # NaN already marks "not computed"
        msg.prompt_logprobs = np.ascontiguousarray(resp.prompt_logprobs_np, np.float32).tobytes()
    elif resp.prompt_logprobs is not None:
        values = [math.nan if v is None else v for v in resp.prompt_logprobs]
        msg.prompt_logprobs = np.array(values, dtype=np.float32).tobytes()
    if resp.topk_prompt_logprobs is not None:
        _fill_topk(msg.topk_prompt_logprobs,
                   _as_topk(resp.topk_prompt_logprobs_np, resp.topk_prompt_logprobs))  # fmt: skip
    return msg


class _Framing(dict[tuple[int, int], tuple[bytes, bytes]]):
    """(tokens, stop reason) -> a sequence's framing: the bytes before its tokens and the bytes
    between its tokens and logprobs (empty without logprobs), as the generated class writes
    them (a zero stop reason and empty tokens are left out; logprobs, optional, are not)."""

    def __init__(self, with_logprobs: bool) -> None:
        super().__init__()
        self.with_logprobs = with_logprobs

    def __missing__(self, key: tuple[int, int]) -> tuple[bytes, bytes]:
        length, stop = key
        size = encode_varint(4 * length)
        fields = b"\x08" + encode_varint(stop) if stop else b""
        tokens = b"\x12" + size if length else b""  # SampledSequence field 2
        between = b"\x1a" + size if self.with_logprobs else b""  # field 3
        body = (
            len(fields)
            + len(tokens)
            + len(between)
            + 4 * length * (bool(length) + self.with_logprobs)
        )
        value = self[key] = (b"\x0a" + encode_varint(body) + fields + tokens, between)
        return value


_FRAMING = {True: _Framing(True), False: _Framing(False)}
_FRAMING_CACHE_MAX = 1 << 16  # distinct (length, stop reason) keys kept per table
# Whole-response framing of batches of equal sequences, per (sequences, token bytes, stop
# reason): a sampler asks with a few shapes again and again (num_samples, max_tokens).
_TEMPLATES: dict[tuple[int, int, str], tuple[np.ndarray, int, int]] = {}
_TEMPLATES_MAX = 64
_TEMPLATE_MAX_BYTES = 1 << 20  # larger responses build their framing each time (~1 us)


def _encode_joined(resp: types.SampleResponse) -> bytes | None:
    """The bytes of a response of numpy int32 tokens, float32 logprobs of the same sizes on
    every sequence or on none, and no top-k; None for any other response."""
    seqs = resp.sequences
    count = len(seqs)
    # one flat list of every sequence's fields, split by slicing (no per-sequence tuple work)
    fields = list(chain.from_iterable(map(_read_fields, seqs)))
    tokens, logprobs = fields[0::5], fields[1::5]
    if fields[3::5].count(None) != count or fields[4::5].count(None) != count:
        return None
    with_logprobs = logprobs[0] is not None
    try:
        if set(map(_dtype, tokens)) != {_INT32}:
            return None
        lengths = list(map(_size, tokens))  # the generated class flattens any shape alike
        if with_logprobs:
            if set(map(_dtype, logprobs)) != {_FLOAT32} or lengths != list(map(_size, logprobs)):
                return None
        elif (
            logprobs.count(None) != count
            or list(map(_read_logprobs_list, seqs)).count(None) != count
        ):
            return None
        stop_names = fields[2::5]
        framing = _FRAMING[with_logprobs]
        if len(framing) > _FRAMING_CACHE_MAX:
            framing.clear()
        width = 4 if with_logprobs else 2
        parts: list[object] = [None] * (width * count)
        if lengths.count(lengths[0]) == count and stop_names.count(stop_names[0]) == count:
            head, between = framing[lengths[0], STOP_REASONS[stop_names[0]]]  # all alike
            parts[0::width] = [head] * count
            if with_logprobs:
                parts[2::width] = [between] * count
        else:
            stops = map(STOP_REASONS.__getitem__, stop_names)
            frames = list(map(framing.__getitem__, zip(lengths, stops, strict=True)))
            parts[0::width] = map(_first, frames)
            if with_logprobs:
                parts[2::width] = map(_second, frames)
        parts[1::width] = tokens
        if with_logprobs:
            parts[3::width] = logprobs
        if _has_rest(resp):
            parts.append(_rest(resp).SerializeToString())
        return b"".join(parts)  # type: ignore[arg-type]
    except (AttributeError, KeyError, ValueError, TypeError):
        # a list field, an unknown stop reason, an array that is not C-contiguous: the
        # generated class takes it
        return None


def _template(count: int, width: int, stop: str) -> tuple[np.ndarray, int, int]:
    """`count` records of `width` token bytes and `stop`, framing written and payloads zero
    (cached), and the payloads' offsets in a record."""
    key = (count, width, stop)
    found = _TEMPLATES.get(key)
    if found is None:
        head, between = _FRAMING[True][width >> 2, STOP_REASONS[stop]]
        row = np.frombuffer(head + bytes(width) + between + bytes(width), np.uint8)
        found = (np.repeat(row[None], count, axis=0), len(head), len(head) + width + len(between))
        if count * len(row) <= _TEMPLATE_MAX_BYTES:
            if len(_TEMPLATES) >= _TEMPLATES_MAX:
                _TEMPLATES.clear()
            _TEMPLATES[key] = found
    return found


def _encode_batch(resp: types.SampleResponse, batch: SampledBatch) -> bytes:
    """The bytes of a response whose sequences are a `SampledBatch` (1-D int32 tokens and
    float32 logprobs on every sequence, no top-k: `SampledBatch.of` checked them)."""
    framing = _FRAMING[True]
    if len(framing) > _FRAMING_CACHE_MAX:
        framing.clear()
    count = len(batch.stop_reasons)
    tokens, logprobs = batch.tokens.view(np.uint8), batch.logprobs.view(np.uint8)
    if batch.uniform:  # one record layout: a cached (sequences, record bytes) array, 2 copies
        width = 4 * int(batch.lengths[0])
        out, at_tokens, at_logprobs = _template(count, width, batch.stop_reasons[0])
        out = out.copy()
        out[:, at_tokens : at_tokens + width] = tokens.reshape(count, width)
        out[:, at_logprobs:] = logprobs.reshape(count, width)
        body = out.tobytes()
    else:  # framing per sequence, joined with slices of the batch's two buffers
        stops = map(STOP_REASONS.__getitem__, batch.stop_reasons)
        frames = list(map(framing.__getitem__, zip(batch.lengths.tolist(), stops, strict=True)))
        ends = (4 * batch.ends).tolist()
        bounds = list(zip([0, *ends[:-1]], ends, strict=True))
        tv, lv = memoryview(tokens), memoryview(logprobs)
        parts: list[object] = [None] * (4 * count)
        parts[0::4] = map(_first, frames)
        parts[1::4] = [tv[x:y] for x, y in bounds]
        parts[2::4] = map(_second, frames)
        parts[3::4] = [lv[x:y] for x, y in bounds]
        body = b"".join(parts)  # type: ignore[arg-type]
    if _has_rest(resp):
        return body + _rest(resp).SerializeToString()
    return body


def _has_rest(resp: types.SampleResponse) -> bool:
    """Whether the response has fields other than `sequences` to write."""
    if not _KNOWN_REST:
        return True
    logprobs, logprobs_list, topk, topk_list, hits = _read_rest(resp)
    return not (logprobs is None and logprobs_list is None and topk is None
                and topk_list is None and not hits)  # fmt: skip


def _as_topk(
    dense: TopkLogprobs | None, rows: list[list[tuple[int, float]] | None]
) -> TopkLogprobs:
    if dense is not None:
        return dense
    k = max((len(r) for r in rows if r), default=0)
    token_ids = np.zeros((len(rows), k), dtype=np.int32)
    logprobs = np.full((len(rows), k), MASK_LOGPROB, dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate(row or []):
            token_ids[i, j], logprobs[i, j] = token, logprob
    return TopkLogprobs(token_ids=token_ids, logprobs=logprobs)


def _fill_topk(msg: pb.TopkLogprobs, topk: TopkLogprobs) -> None:
    length, k = topk.token_ids.shape
    msg.length, msg.k = length, k
    msg.token_ids = np.ascontiguousarray(topk.token_ids, dtype=np.int32).tobytes()
    msg.logprobs = np.ascontiguousarray(topk.logprobs, dtype=np.float32).tobytes()
