"""Harbor trials through the gateway on both backends (the local backend's sampling client, and
the official tinker SDK's through `oneloop serve`): Harbor's own terminus-2, unmodified, reaches
its model only through LiteLLM's OpenAI client, and its trials train with exact TITO accounting."""

import asyncio

import tinker

from oneloop.agents.demo_tasks import generate_tasks
from oneloop.agents.tito import Trajectory
from oneloop.agents.trials import TrialOutcome, TrialRunner, TrialRunnerConfig
from oneloop.backends.megatron_local.serve.server import ServeConfig, ServerThread

TERMINUS_KWARGS = {
    "max_turns": 1, "record_terminal_session": False, "enable_summarize": False,
    "suppress_max_turns_warning": True, "context_window": 4096,
    # LiteLLM knows no `openai/oneloop`: its limits and (zero) prices, so nothing is looked up.
    "model_info": {"max_input_tokens": 4096, "max_output_tokens": 64,
                   "input_cost_per_token": 0.0, "output_cost_per_token": 0.0},
}  # fmt: skip


def test_terminus_2_trials_through_the_gateway_on_both_backends(
    local_service, tiny_model_path, tmp_path
):
    from oneloop.tiny.model import TINY_MODEL_NAME

    splits = generate_tasks(tmp_path / "tasks", n_train=1, n_eval=0, seed=5)
    runner = TrialRunner(TrialRunnerConfig(
        trials_dir=tmp_path / "trials", agent_import_path=None, agent_name="terminus-2",
        agent_kind="openai_gateway",
        agent_kwargs={"tokenizer_path": str(tiny_model_path), **TERMINUS_KWARGS},
        environment_kwargs={"root_base_dir": str(tmp_path / "roots")},
        trials_per_second=50.0, max_infra_retries=0,
    ))  # fmt: skip

    def group(sampler, n):
        per_trial = [{"seed": 100 + i, "sampler_version": 0} for i in range(n)]
        run = runner.run_group(splits.train[0].path, n, sampler, agent_kwargs=per_trial)
        return asyncio.run(asyncio.wait_for(run, 300))

    client = local_service.create_sampling_client(base_model=TINY_MODEL_NAME).result()
    check(group(client, 2))
    # The tinker backend's path: the official SDK's sampling client of `oneloop serve`.
    with ServerThread(ServeConfig(port=0), local_service) as server:
        sdk = tinker.ServiceClient(base_url=server.base_url, api_key="tml-any-key-on-loopback")
        try:
            sampler = sdk.create_sampling_client(base_model=TINY_MODEL_NAME).result(timeout=120)
            check(group(sampler, 1))
        finally:
            sdk.close("success").result(timeout=60)


def check(group):
    assert not group.masked, [r.error for r in group.results]
    for result in group.results:
        assert result.outcome in (TrialOutcome.OK, TrialOutcome.TRUNCATED), result.error
        assert result.reward is not None
        gateway = result.agent_stats["gateway"]
        # terminus-2 re-sends its whole history each turn: all but the first continue (a
        # request refused for the context window continued too, then stopped the agent).
        assert gateway["requests"] >= 1
        assert gateway["continued"] == gateway["requests"] - 1 + gateway["context_overflows"]
        assert gateway["history_rewrites"] == 0 and gateway["segments"] == 1
        trajectory = Trajectory.from_json(result.trajectory)  # digests re-checked
        assert len(trajectory.sampled_segments) == gateway["requests"]
        assert all(len(s.tokens) <= 512 and s.version is not None
                   for s in trajectory.sampled_segments)  # fmt: skip
        datum = trajectory.to_datum(1.0)
        assert datum.loss_fn_inputs["weights"].to_numpy().sum() == trajectory.num_sampled_tokens
