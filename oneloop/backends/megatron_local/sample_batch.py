"""A sample call's sequences as batched arrays, and the SDK's `SampledSequence`s built from them
only when someone reads them.

Why: a `SampleResponse` of 64 short sequences is 64 frozen SDK objects, and anything that walks
them (`oneloop serve`'s protobuf encoder, ~25 us for 64 x 32 tokens) pays per object. So the
local sampling client makes the batch once, where it receives the engine's output:
`SampledBatch` holds every sequence's tokens in one int32 array, its logprobs in one float32
array, the lengths and the stop reasons. The response's `sequences` is a `SampledSequences`, a
read-only `Sequence[types.SampledSequence]` (the type the SDK declares for the field) holding
the batch; its SDK objects are built on first access, exactly as they were built before
(the engine's own arrays as `tokens_np` / `logprobs_np`, the same sequence ids). So in-process
callers see the SDK's types, and the server's encoder reads the batch with a fixed number of
numpy calls (`serve/codec/sample_encoder.py`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, overload

import numpy as np
from tinker import types

from oneloop.backends.megatron_local.engines.base import SampledArrays
from oneloop.backends.sequence_ids import attach_routed_experts, make_sequence_id

_INT32, _FLOAT32 = np.dtype(np.int32), np.dtype(np.float32)
_tokens, _logprobs, _stop = attrgetter("tokens"), attrgetter("logprobs"), attrgetter("stop_reason")


@dataclass(frozen=True)
class SampledBatch:
    """All sequences of one sample call, joined: sequence i is `tokens[starts[i]:ends[i]]`."""

    tokens: np.ndarray  # int32 [sum of lengths]
    logprobs: np.ndarray  # float32 [sum of lengths]
    lengths: np.ndarray  # int64 [sequences]
    ends: np.ndarray  # int64 [sequences]: cumulative lengths
    stop_reasons: tuple[str, ...]  # "stop" | "length" per sequence
    uniform: bool  # every sequence has the same length and stop reason

    @classmethod
    def of(cls, sequences: Sequence[SampledArrays]) -> SampledBatch | None:
        """The batch of an engine's sequences, or None unless every sequence holds 1-D int32
        tokens and float32 logprobs of the same length (the engine contract)."""
        if not sequences:
            return None
        tokens = list(map(_tokens, sequences))
        logprobs = list(map(_logprobs, sequences))
        try:
            lengths = list(map(len, tokens))
            if list(map(len, logprobs)) != lengths:
                return None
            joined, joined_logprobs = np.concatenate(tokens), np.concatenate(logprobs)
        except (TypeError, ValueError):  # None, a 0-d array, arrays of different ranks
            return None
        # Joining promotes dtypes: any other dtype shows in the result, and a 2-D array gives
        # a 2-D result (or a size other than the sum of first dimensions).
        if (
            joined.dtype != _INT32
            or joined_logprobs.dtype != _FLOAT32
            or joined.ndim != 1
            or joined_logprobs.ndim != 1
            or joined.size != sum(lengths)
        ):
            return None
        count = len(lengths)
        stops = tuple(map(_stop, sequences))
        return cls(
            tokens=joined,
            logprobs=joined_logprobs,
            lengths=np.array(lengths, np.int64),
            ends=np.cumsum(lengths, dtype=np.int64),
            stop_reasons=stops,
            uniform=stops.count(stops[0]) == count and lengths.count(lengths[0]) == count,
        )


class SampledSequences(Sequence[types.SampledSequence]):
    """A sample call's `types.SampledSequence`s, built on first access from the engine's
    sequences; `batch` holds the same data joined (see the module docstring)."""

    __slots__ = ("_built", "_first", "_namespace", "_sequences", "_version", "batch")

    def __init__(
        self,
        batch: SampledBatch,
        sequences: Sequence[SampledArrays],
        namespace: str,
        version: int,
        first: int,
    ) -> None:
        self.batch = batch
        self._sequences = sequences
        self._namespace, self._version, self._first = namespace, version, first
        self._built: list[types.SampledSequence] | None = None

    @property
    def version(self) -> int:
        """The weight version every sequence started on (also in each sequence id)."""
        return self._version

    def _items(self) -> list[types.SampledSequence]:
        if self._built is None:
            self._built = build_sequences(
                self._sequences, self._namespace, self._version, self._first
            )
        return self._built

    def __len__(self) -> int:
        return len(self._sequences)

    @overload
    def __getitem__(self, index: int) -> types.SampledSequence: ...
    @overload
    def __getitem__(self, index: slice) -> list[types.SampledSequence]: ...
    def __getitem__(self, index: Any) -> Any:
        return self._items()[index]

    def __iter__(self) -> Iterator[types.SampledSequence]:
        return iter(self._items())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return self._items() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compares by value like a list

    def __repr__(self) -> str:
        return repr(self._items())

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.batch, self._sequences, self._namespace, self._version, self._first)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.batch, self._sequences, self._namespace, self._version, self._first = state
        self._built = None


def build_sequences(
    sequences: Sequence[SampledArrays], namespace: str, version: int, first: int
) -> list[types.SampledSequence]:
    """The SDK objects of an engine's sequences, ids `<namespace>/v<version>/<first + i>`; an MoE
    sampler's routed experts ride along (`sequence_ids.attach_routed_experts`)."""
    built = [
        types.SampledSequence(
            stop_reason=seq.stop_reason,  # type: ignore[arg-type]
            sequence_id=make_sequence_id(namespace, version, first + i),
            tokens_np=seq.tokens,
            logprobs_np=seq.logprobs,
        )
        for i, seq in enumerate(sequences)
    ]
    for sdk, seq in zip(built, sequences, strict=True):
        routing = getattr(seq, "routed_experts", None)
        if routing is not None:
            attach_routed_experts(sdk, routing)
    return built


def sample_response(
    sequences: Sequence[SampledArrays],
    prompt_logprobs: np.ndarray | None,
    namespace: str,
    version: int,
    first: int,
) -> types.SampleResponse:
    """The SDK response of an engine's output: sequences batched (`SampledSequences`) when
    they follow the engine contract, else the SDK objects built at once."""
    batch = SampledBatch.of(sequences)
    seqs: Sequence[types.SampledSequence] = (
        build_sequences(sequences, namespace, version, first)
        if batch is None
        else SampledSequences(batch, sequences, namespace, version, first)
    )
    return types.SampleResponse(sequences=seqs, prompt_logprobs_np=prompt_logprobs)
