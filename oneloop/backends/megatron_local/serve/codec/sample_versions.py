"""The weight versions a sample response's sequences ran on, as `serve/service.py` reads them
for the `asample` acknowledgement and the fixed-weights check.

A response from the local sampling client carries its sequences batched
(`sample_batch.SampledSequences`): one version for the whole batch, read without building the
64 SDK `SampledSequence` objects. Any other response is read sequence by sequence, from each
sequence id (`sequence_ids.sampled_version`).
"""

from __future__ import annotations

from tinker import types

from oneloop.backends.megatron_local.sample_batch import SampledSequences
from oneloop.backends.sequence_ids import sampled_version


def sampled_versions(resp: types.SampleResponse) -> list[int | None]:
    """Each sequence's version (None where its id records none)."""
    sequences = resp.sequences
    if isinstance(sequences, SampledSequences):
        return [sequences.version] * len(sequences)
    return [sampled_version(seq) for seq in sequences]


def check_fixed_version(resp: types.SampleResponse, version: int, sampler_id: str) -> None:
    """A fixed-weights sampler's ids were acknowledged with `version` before it ran: a sample
    that reports another version would make those ids wrong, so it fails loudly instead."""
    for i, ran in enumerate(sampled_versions(resp)):
        if ran is not None and ran != version:
            raise RuntimeError(
                f"sequences[{i}]: sampler {sampler_id} has fixed weights of version {version} "
                f"but the sample ran on version {ran}"
            )
