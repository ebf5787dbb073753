"""Token-in/token-out (TITO) trajectories: the exact tokens a sampler saw and produced.

This module owns `Trajectory`, an append-only list of segments `prompt | sampled | observation`,
and its conversion to a training `tinker.types.Datum`. Nothing here ever tokenises text: every
token is either the initial prompt, a sampler's output (kept verbatim with its per-token logprobs
and the sampler weight version it started on), or an observation delta produced by a renderer.

Contracts:
* each sample request's prompt is exactly the concatenation of all segments so far
  (`Trajectory.append_sampled` checks it and raises `TitoError` naming the first mismatch);
* a sampled segment stores a blake2b digest of its tokens (int32 bytes) taken when it was
  appended; `to_datum` recomputes it, so a trajectory corrupted on its way through JSON,
  checkpoints or a buggy caller is refused instead of trained on;
* `to_datum(advantage)` gives `model_input = full[:-1]`, `target_tokens = full[1:]`, `weights` 1 on
  sampled positions and 0 elsewhere, `logprobs` (the sampler's, 0 elsewhere) and `advantages`
  (the scalar spread over sampled positions, 0 elsewhere), all aligned with the targets;
  when the last segment is a sample whose sampler recorded its routing (MoE models on the local
  backend, `sequence_ids.routed_experts`), also `routed_experts` [len(full) - 1, MoE layers,
  top-k] for rollout routing replay (in `to_json` for the last segment only, as int16 base64:
  trajectories come back from trials as JSON).
"""

from __future__ import annotations

import array
import base64
import functools
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from tinker import types

from oneloop.backends.sequence_ids import routed_experts, sampled_version
from oneloop.errors import OneloopError

SegmentKind = Literal["prompt", "sampled", "observation"]
SEGMENT_KINDS: tuple[SegmentKind, ...] = ("prompt", "sampled", "observation")
# Bumped when the JSON form changes; `from_json` refuses other versions.
JSON_FORMAT = 1


class TitoError(OneloopError, ValueError):
    """A trajectory would break token-in/token-out: wrong prompt, bad segment, corrupted tokens."""


def token_digest(tokens: Sequence[int] | np.ndarray) -> str:
    """blake2b (16-byte) hex digest of `tokens` as little-endian int32 bytes."""
    array = np.asarray(tokens, dtype="<i4")
    return hashlib.blake2b(array.tobytes(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class Segment:
    """One run of tokens with a single origin.

    `logprobs`, `version` and `digest` are set on sampled segments only (`version` may be None if
    neither the sequence id nor the caller knew it); prompt and observation segments carry none.
    """

    kind: SegmentKind
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    version: int | None = None
    digest: str | None = None
    stop_reason: str | None = None
    routing: np.ndarray | None = field(default=None, compare=False, repr=False)
    """The sampler's routed experts for the request's prompt and this segment (R3); not saved."""

    def __post_init__(self) -> None:
        if self.kind not in SEGMENT_KINDS:
            raise TitoError(f"segment.kind: expected one of {SEGMENT_KINDS}, got {self.kind!r}")
        if self.kind == "sampled":
            if self.logprobs is None or len(self.logprobs) != len(self.tokens):
                got = None if self.logprobs is None else len(self.logprobs)
                raise TitoError(
                    f"segment.logprobs: a sampled segment needs one logprob per token "
                    f"({len(self.tokens)}), got {got}"
                )
            if self.digest is None:
                raise TitoError("segment.digest: a sampled segment needs the digest of its tokens")
        elif self.logprobs is not None or self.version is not None or self.digest is not None:
            raise TitoError(
                f"segment: a {self.kind} segment carries no logprobs, version or digest"
            )

    def to_json(self, routing: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "tokens": list(self.tokens)}
        if self.kind == "sampled":
            out |= {
                "logprobs": list(self.logprobs or ()),
                "version": self.version,
                "digest": self.digest,
                "stop_reason": self.stop_reason,
            }
            if routing and self.routing is not None:
                out["routed_experts"] = _routing_to_json(self.routing)
        return out

    @classmethod
    def from_json(cls, data: Any, where: str = "segment") -> Segment:
        if not isinstance(data, dict):
            raise TitoError(f"{where}: expected an object, got {type(data).__name__}")
        kind = data.get("kind")
        if kind not in SEGMENT_KINDS:
            raise TitoError(f"{where}.kind: expected one of {SEGMENT_KINDS}, got {kind!r}")
        tokens = _int_list(data.get("tokens"), f"{where}.tokens")
        if kind != "sampled":
            extra = set(data) - {"kind", "tokens"}
            if extra:
                raise TitoError(f"{where}: unknown keys {sorted(extra)} for kind {kind!r}")
            return cls(kind=kind, tokens=tokens)  # type: ignore[arg-type]
        logprobs = data.get("logprobs")
        if not isinstance(logprobs, list) or not all(
            isinstance(x, int | float) and not isinstance(x, bool) for x in logprobs
        ):
            raise TitoError(f"{where}.logprobs: expected a list of numbers")
        version = data.get("version")
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
            raise TitoError(f"{where}.version: expected an integer or null, got {version!r}")
        digest = data.get("digest")
        if not isinstance(digest, str):
            raise TitoError(f"{where}.digest: expected a string, got {digest!r}")
        stop_reason = data.get("stop_reason")
        if stop_reason is not None and not isinstance(stop_reason, str):
            raise TitoError(f"{where}.stop_reason: expected a string or null")
        routing = data.get("routed_experts")
        return cls(
            kind="sampled",
            tokens=tokens,
            logprobs=tuple(float(x) for x in logprobs),
            version=version,
            digest=digest,
            stop_reason=stop_reason,
            routing=None if routing is None else _routing_from_json(routing, where),
        )


@dataclass(frozen=True)
class Trajectory:
    """An append-only TITO trajectory. Appending returns a new trajectory; nothing is mutated.

    All tokens so far are kept as one tuple (`_all_tokens`, cached, extended by each append), so
    a turn costs one C-level copy of the history, never a Python loop over it. `model_input()`
    hands out that immutable tuple as its chunk's tokens, so checking a prompt built by it is an
    identity test; any other prompt is compared token by token.
    """

    segments: tuple[Segment, ...]
    length: int

    @classmethod
    def start(cls, prompt_tokens: Sequence[int]) -> Trajectory:
        """A trajectory holding only the initial prompt (must be non-empty)."""
        tokens = _int_tuple(prompt_tokens, "prompt_tokens")
        if not tokens:
            raise TitoError("prompt_tokens: the initial prompt must hold at least one token")
        return cls(segments=(Segment("prompt", tokens),), length=len(tokens))

    def __post_init__(self) -> None:
        if not self.segments or self.segments[0].kind != "prompt":
            raise TitoError("segments[0]: a trajectory starts with exactly one prompt segment")
        if any(s.kind == "prompt" for s in self.segments[1:]):
            raise TitoError("segments: only the first segment may be a prompt")
        total = sum(len(s.tokens) for s in self.segments)
        if total != self.length:
            raise TitoError(f"length: {self.length} but the segments hold {total} tokens")

    @functools.cached_property
    def _all_tokens(self) -> tuple[int, ...]:
        out: tuple[int, ...] = ()
        for segment in self.segments:
            out += segment.tokens
        return out

    def __getstate__(self) -> dict[str, Any]:
        # Pickled (Ray returns trajectories from trial tasks) without the cache: it is rebuilt.
        return {k: v for k, v in self.__dict__.items() if k != "_all_tokens"}

    def _extended(self, segment: Segment) -> Trajectory:
        new = Trajectory(self.segments + (segment,), self.length + len(segment.tokens))
        new.__dict__["_all_tokens"] = self._all_tokens + segment.tokens  # seeds the cache
        return new

    @property
    def tokens(self) -> list[int]:
        """All tokens so far, in order (the next sample's prompt)."""
        return list(self._all_tokens)

    def model_input(self) -> types.ModelInput:
        """The next sample request's prompt: exactly the concatenation so far (its one chunk
        holds the tokens as a tuple)."""
        return _token_model_input(self._all_tokens)

    @property
    def sampled_segments(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.kind == "sampled")

    @property
    def num_sampled_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.segments if s.kind == "sampled")

    def check_prompt(self, prompt: types.ModelInput | Sequence[int]) -> None:
        """Raise `TitoError` unless `prompt` is exactly this trajectory's tokens."""
        sent = _prompt_tokens(prompt)
        if sent is self._all_tokens or (len(sent) == self.length and sent == self._all_tokens):
            return
        sent, mine = list(sent), self.tokens
        first = next(
            (i for i, (a, b) in enumerate(zip(sent, mine, strict=False)) if a != b),
            min(len(sent), len(mine)),
        )
        raise TitoError(
            f"sample prompt is not the trajectory so far: {len(sent)} tokens sent, "
            f"{len(mine)} in the trajectory, first difference at position {first} "
            f"(sent {sent[first : first + 4]}, trajectory {mine[first : first + 4]}); "
            "build each request's prompt with Trajectory.model_input()"
        )

    def append_sampled(
        self,
        sequence: types.SampledSequence,
        *,
        prompt: types.ModelInput | Sequence[int],
        fallback_version: int | None = None,
    ) -> Trajectory:
        """Append a sampler's output, verbatim, after checking the request's `prompt`.

        The version is the one recorded in the sequence id (`sampled_version`), else
        `fallback_version` (the version of the sampling client the caller used).
        """
        self.check_prompt(prompt)
        tokens_np = (
            np.asarray(sequence.tokens_np)
            if sequence.tokens_np is not None
            else np.asarray(sequence.tokens, dtype=np.int64)
        )
        logprobs = sequence.logprobs
        if logprobs is None:
            raise TitoError(
                "sequence.logprobs: the sampler returned no logprobs; TITO training needs them"
            )
        if len(logprobs) != len(tokens_np):
            raise TitoError(
                f"sequence.logprobs: {len(logprobs)} logprobs for {len(tokens_np)} tokens"
            )
        version = sampled_version(sequence)
        segment = Segment(
            kind="sampled",
            tokens=tuple(int(t) for t in tokens_np.tolist()),
            logprobs=tuple(float(x) for x in logprobs),
            version=version if version is not None else fallback_version,
            digest=token_digest(tokens_np),
            stop_reason=sequence.stop_reason,
            routing=routed_experts(sequence),
        )
        return self._extended(segment)

    def append_observation(self, tokens: Sequence[int]) -> Trajectory:
        """Append environment tokens (a renderer's observation delta); never trained on."""
        segment = Segment("observation", _int_tuple(tokens, "observation tokens"))
        return self._extended(segment)

    def verify(self) -> None:
        """Re-check every sampled segment's digest; raise `TitoError` on the first mismatch."""
        for index, segment in enumerate(self.segments):
            if segment.kind == "sampled" and token_digest(segment.tokens) != segment.digest:
                raise TitoError(
                    f"segments[{index}]: sampled tokens changed since sampling (digest "
                    f"{token_digest(segment.tokens)} != recorded {segment.digest})"
                )

    def to_datum(self, advantage: float) -> types.Datum:
        """The training datum: inputs `full[:-1]`, targets `full[1:]`, aligned loss inputs."""
        if not math.isfinite(advantage):
            raise TitoError(f"advantage: must be finite, got {advantage}")
        if self.length < 2:
            raise TitoError(f"length: a datum needs at least 2 tokens, got {self.length}")
        self.verify()
        # array.array converts a tuple of ints at C speed, about 3x np.fromiter's rate.
        full = np.frombuffer(array.array("q", self._all_tokens), dtype=np.int64)
        mask = np.zeros(self.length, dtype=np.float32)
        logprobs = np.zeros(self.length, dtype=np.float32)
        offset = 0
        for segment in self.segments:
            end = offset + len(segment.tokens)
            if segment.kind == "sampled":
                mask[offset:end] = 1.0
                logprobs[offset:end] = segment.logprobs or ()
            offset = end
        targets_mask = mask[1:]
        extra = {}
        last = self.segments[-1]
        if last.routing is not None and len(last.routing) == self.length - 1:
            extra["routed_experts"] = types.TensorData.from_numpy(last.routing.astype(np.int64))
        return types.Datum(
            model_input=_token_model_input(list(self._all_tokens[:-1])),
            loss_fn_inputs={
                **extra,
                "target_tokens": types.TensorData.from_numpy(full[1:]),
                "weights": types.TensorData.from_numpy(targets_mask.copy()),
                "logprobs": types.TensorData.from_numpy(logprobs[1:].copy()),
                "advantages": types.TensorData.from_numpy(
                    (targets_mask * np.float32(advantage)).astype(np.float32)
                ),
            },
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict (for checkpoints and trajectories.jsonl)."""
        return {
            "format": JSON_FORMAT,
            "length": self.length,
            "segments": [
                s.to_json(routing=i == len(self.segments) - 1) for i, s in enumerate(self.segments)
            ],
        }

    @classmethod
    def from_json(cls, data: Any) -> Trajectory:
        """Inverse of `to_json`; every field is validated and digests are re-checked."""
        if not isinstance(data, dict):
            raise TitoError(f"trajectory: expected an object, got {type(data).__name__}")
        if data.get("format") != JSON_FORMAT:
            raise TitoError(
                f"trajectory.format: expected {JSON_FORMAT}, got {data.get('format')!r}"
            )
        raw = data.get("segments")
        if not isinstance(raw, list):
            raise TitoError("trajectory.segments: expected a list")
        segments = tuple(
            Segment.from_json(s, f"trajectory.segments[{i}]") for i, s in enumerate(raw)
        )
        length = data.get("length")
        if not isinstance(length, int) or isinstance(length, bool):
            raise TitoError(f"trajectory.length: expected an integer, got {length!r}")
        trajectory = cls(segments=segments, length=length)
        trajectory.verify()
        return trajectory


def _token_model_input(tokens: Sequence[int]) -> types.ModelInput:
    """`ModelInput.from_ints(tokens)` without pydantic re-checking every id: a trajectory's
    tokens were validated (non-negative ints) when their segment was appended."""
    chunk = types.EncodedTextChunk.model_construct(tokens=tokens)
    return types.ModelInput.model_construct(chunks=[chunk])


def _prompt_tokens(prompt: types.ModelInput | Sequence[int]) -> tuple[int, ...]:
    """The token ids of a sample request's prompt, as a tuple (compared at C speed)."""
    if not isinstance(prompt, types.ModelInput):
        return tuple(prompt)
    chunks = prompt.chunks
    if len(chunks) == 1 and isinstance(chunks[0], types.EncodedTextChunk):
        return tuple(chunks[0].tokens)  # the same object when it already is a tuple
    return tuple(prompt.to_ints())


def _int_tuple(tokens: Sequence[int] | np.ndarray, where: str) -> tuple[int, ...]:
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise TitoError(f"{where}: expected a 1-D integer array, got {tokens.dtype}")
        return tuple(tokens.tolist())
    out = tuple(tokens)
    if set(map(type, out)) <= {int}:  # the common case (plain ints), checked at C speed
        try:
            array.array("Q", out)  # sign check at C speed: a negative id overflows "Q"
        except OverflowError:  # a negative id, or one of 2**64 or more (allowed)
            if min(out) < 0:
                raise TitoError(
                    f"{where}: expected non-negative token ids, got {min(out)}"
                ) from None
        return out
    for t in out:
        if not isinstance(t, int | np.integer) or isinstance(t, bool) or t < 0:
            raise TitoError(f"{where}: expected non-negative token ids, got {t!r}")
    return tuple(int(t) for t in out)


def _int_list(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise TitoError(f"{where}: expected a list of token ids")
    return _int_tuple(value, where)


def _routing_to_json(routing: np.ndarray) -> dict[str, Any]:
    data = np.ascontiguousarray(routing, dtype="<i2")
    return {"shape": list(data.shape), "int16_b64": base64.b64encode(data.tobytes()).decode()}


def _routing_from_json(data: Any, where: str) -> np.ndarray:
    try:
        shape = tuple(int(n) for n in data["shape"])
        flat = np.frombuffer(base64.b64decode(data["int16_b64"]), dtype="<i2")
        return flat.reshape(shape).astype(np.int16)
    except (KeyError, TypeError, ValueError) as error:
        raise TitoError(
            f"{where}.routed_experts: expected {{shape: [positions, layers, top-k], int16_b64: "
            f"base64 of little-endian int16}} ({error})"
        ) from None
