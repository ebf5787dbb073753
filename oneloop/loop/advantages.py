"""From finished rollout groups to training datums, and the trainer-vs-sampler logprob check.

- Advantages are group-relative: reward − group mean (optionally ÷ group std).
- Reductions are done here by scaling advantages, never by the backend, so both backends compute
  the same objective with Tinker's sum-losses: `token_sum` (as is), `token_mean` (÷ sampled tokens
  in the batch), `prompt_mean` (÷ groups in the batch × sampled tokens of that group).
- RL losses take no `weights` input (Tinker's service rejects it); the TITO datum's weights are
  used as the mask for the logprob check and then dropped.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tinker import types

from oneloop.agents.tito import Trajectory


@dataclass(frozen=True)
class ScoredGroup:
    """A finished, accepted group: its trajectories, rewards and the version it started on."""

    sample_id: str
    task: str
    version: int
    trajectories: tuple[Trajectory, ...]
    rewards: tuple[float, ...]
    """One per trajectory: its trial's reward."""
    trials: tuple[int, ...] = ()
    """The trial each trajectory came from (a multi-step task's steps, a gateway session's
    segments); empty: one trial per trajectory. Advantages are group-relative over trials, so
    a trial of several trajectories counts once in the group's mean and spread."""

    @classmethod
    def of_trials(
        cls, sample_id: str, task: str, version: int,
        trials: Sequence[tuple[Sequence[Trajectory], float]],
    ) -> "ScoredGroup":  # fmt: skip
        """A group from its trials: each trial's trajectories, trained with its reward."""
        return cls(
            sample_id, task, version,
            tuple(t for trajectories, _ in trials for t in trajectories),
            tuple(reward for trajectories, reward in trials for _ in trajectories),
            tuple(i for i, (trajectories, _) in enumerate(trials) for _ in trajectories),
        )  # fmt: skip

    def advantages(self, std_normalize: bool) -> np.ndarray:
        """Each trajectory's advantage: its trial's reward against the group's trials."""
        if not self.trials:
            return group_advantages(list(self.rewards), std_normalize)
        per_trial = dict(zip(self.trials, self.rewards, strict=True))  # one reward per trial
        order = sorted(per_trial)
        values = dict(zip(order, group_advantages([per_trial[t] for t in order], std_normalize),
                          strict=True))  # fmt: skip
        return np.asarray([values[t] for t in self.trials], dtype=np.float64)


def group_advantages(rewards: list[float], std_normalize: bool) -> np.ndarray:
    """reward − mean (÷ std when asked and the std is non-zero)."""
    values = np.asarray(rewards, dtype=np.float64)
    centered = values - values.mean()
    if std_normalize:
        std = values.std()
        if std > 0:
            centered = centered / std
    return centered


def has_variance(rewards: list[float]) -> bool:
    return len(set(rewards)) > 1


def build_datums(
    groups: list[ScoredGroup], reduction: str, std_normalize: bool, routing_replay: bool = False
) -> tuple[list[types.Datum], list[np.ndarray]]:
    """RL datums for `groups` (in the given order) and each datum's sampled-position mask; the
    sampler's routed experts (`routed_experts`) are kept only with `routing_replay` (R3)."""
    dropped = {"weights"} if routing_replay else {"weights", "routed_experts"}
    total_tokens = sum(t.num_sampled_tokens for g in groups for t in g.trajectories)
    datums, masks = [], []
    for group in groups:
        advantages = group.advantages(std_normalize)
        group_tokens = sum(t.num_sampled_tokens for t in group.trajectories)
        for trajectory, advantage in zip(group.trajectories, advantages, strict=True):
            scale = 1.0
            if reduction == "token_mean":
                scale = 1.0 / max(total_tokens, 1)
            elif reduction == "prompt_mean":
                scale = 1.0 / (len(groups) * max(group_tokens, 1))
            datum = trajectory.to_datum(float(advantage * scale))
            mask = datum.loss_fn_inputs["weights"].to_numpy() > 0
            inputs = {k: v for k, v in datum.loss_fn_inputs.items() if k not in dropped}
            datums.append(types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs))
            masks.append(mask)
    return datums, masks


def logprob_gap(
    datums: list[types.Datum], masks: list[np.ndarray], output: types.ForwardBackwardOutput
) -> dict[str, float]:
    """Trainer target logprobs vs the sampler's on sampled tokens: mean/max |Δ| and KL(k3)."""
    diffs = []
    for datum, mask, out in zip(datums, masks, output.loss_fn_outputs, strict=True):
        trainer = out["logprobs"].to_numpy().astype(np.float64)[mask]
        sampler = datum.loss_fn_inputs["logprobs"].to_numpy().astype(np.float64)[mask]
        diffs.append(trainer - sampler)
    if not diffs or sum(len(d) for d in diffs) == 0:
        return {}
    delta = np.concatenate(diffs)
    # k3 estimator of KL(sampler || trainer) on tokens drawn from the sampler.
    kl = float(np.mean(np.exp(delta) - 1.0 - delta))
    return {
        "train/logprob_gap_mean": float(np.abs(delta).mean()),
        "train/logprob_gap_max": float(np.abs(delta).max()),
        "train/kl_sample_train": kl,
    }


def logprob_gap_per_datum(
    datums: list[types.Datum], masks: list[np.ndarray], output: types.ForwardBackwardOutput
) -> list[dict[str, float]]:
    """Per datum (same order): mean and max |trainer − sampler| logprob on its sampled tokens."""
    gaps = []
    for datum, mask, out in zip(datums, masks, output.loss_fn_outputs, strict=True):
        trainer = out["logprobs"].to_numpy().astype(np.float64)[mask]
        sampler = datum.loss_fn_inputs["logprobs"].to_numpy().astype(np.float64)[mask]
        delta = np.abs(trainer - sampler)
        gaps.append({
            "gap_mean": float(delta.mean()) if delta.size else 0.0,
            "gap_max": float(delta.max()) if delta.size else 0.0,
            "tokens": float(delta.size),
        })  # fmt: skip
    return gaps
