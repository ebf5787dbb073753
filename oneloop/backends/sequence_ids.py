"""Sequence ids that carry the sampler weight version a sample started on.

`tinker.types.SampledSequence` has no version field, but every sequence has a session-scoped
`sequence_id` string that travels unchanged through the Tinker wire protocol. The local backend
writes ids of the form `<namespace>/v<version>/<index>`, so the agent can record the version a
sample started on whichever way it was reached (in process or through `oneloop serve`). Sequences
from a service that does not follow this form (Thinking Machines' Tinker) give `None`; callers then
fall back to the version of the sampling client they used.
"""

import re

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
