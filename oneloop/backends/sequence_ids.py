"""Sequence ids that carry the sampler weight version a sample started on.

`tinker.types.SampledSequence` has no version field, but every sequence has a session-scoped
`sequence_id` string that travels unchanged through the Tinker wire protocol. The local backend
writes ids of the form `<namespace>/v<version>/<index>`, so the agent can record the version a
sample started on whichever way it was reached (in process or through `oneloop serve`). Sequences
from a service that does not follow this form (Thinking Machines' Tinker) give `None`; callers then
fall back to the version of the sampling client they used.
"""

import re

import numpy as np
from tinker import types

_SEQUENCE_ID = re.compile(r"^(?P<namespace>[^/]+)/v(?P<version>\d+)/(?P<index>\d+)$")


def make_sequence_id(namespace: str, version: int, index: int) -> str:
    """The id of the `index`-th sequence a sampler returned in `namespace` at `version`."""
    if "/" in namespace:
        raise ValueError(f"sequence id namespace must not contain '/': {namespace!r}")
    return f"{namespace}/v{version}/{index}"


def sampled_version(sequence: types.SampledSequence) -> int | None:
    """The weight version `sequence` started on, or None if its id does not record one."""
    match = _SEQUENCE_ID.match(sequence.sequence_id or "")
    return int(match["version"]) if match else None


ROUTED_EXPERTS_ATTR = "oneloop_routed_experts"
"""The local backend's extension on a `SampledSequence` (rollout routing replay, R3): int16
[prompt + tokens - 1, MoE layers, top-k], the experts each fed position was routed to. Set on
the SDK object in this process (it pickles with it); a Tinker service's sequences have none."""


def attach_routed_experts(sequence: types.SampledSequence, routing: np.ndarray) -> None:
    """Record `routing` on `sequence` (a frozen dataclass: set past its field guard)."""
    object.__setattr__(sequence, ROUTED_EXPERTS_ATTR, routing)


def routed_experts(sequence: types.SampledSequence) -> np.ndarray | None:
    """The routing the sampler recorded for `sequence`, or None."""
    return getattr(sequence, ROUTED_EXPERTS_ATTR, None)
