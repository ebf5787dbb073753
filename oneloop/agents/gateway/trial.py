"""One Harbor trial through the gateway: the trial runner's side of `agent.kind: openai_gateway`.

This module owns `GatewayTrial`: in the trial's own process it starts an in-process `Gateway`
(loopback, a free port), opens the trial's session over the trial's sampling client, rewrites
the Harbor agent config so the agent's model endpoint is that session (`model_name`
`openai/<name>`, kwarg `api_base` as terminus-2 and other LiteLLM agents name it, and
`OPENAI_API_KEY` in the agent's env), and at the end closes the
session and puts its TITO trajectory into the agent's metadata the way our MCP agent does
(`tito`: the last segment; `gateway`: the session's counters and earlier segments).
Agent kwargs the gateway consumes (`GATEWAY_KWARGS`) are taken out of the agent's kwargs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the HTTP stack loads when a trial starts, not when the loop imports this
    from oneloop.agents.gateway.server import Gateway

MODEL_NAME = "oneloop"
# Runner/loop kwargs that configure the gateway's session, not the agent.
GATEWAY_KWARGS = frozenset({
    "tokenizer_path", "sampler_key", "context_window", "seed", "sampler_version",
    "template_kwargs", "sample_timeout_s", "gateway_max_tokens",
})  # fmt: skip
METADATA_GATEWAY = "gateway"


class GatewayTrial:
    """The gateway of one trial; `start` before `Trial.create`, `finish` after, `stop` always."""

    def __init__(self, agent_kwargs: dict[str, Any], sampling_client: Any, trial_name: str):
        if sampling_client is None:
            raise ValueError("agent.kind openai_gateway needs a sampling client")
        own = {k: v for k, v in agent_kwargs.items() if k in GATEWAY_KWARGS}
        if not isinstance(own.get("tokenizer_path"), str):
            raise ValueError("agent.kwargs.tokenizer_path: the gateway needs the tokenizer")
        self.agent_kwargs = {k: v for k, v in agent_kwargs.items() if k not in GATEWAY_KWARGS}
        overrides = {"seed": own.get("seed"), "sampler_version": own.get("sampler_version")}
        if "context_window" in own:
            overrides["context_window"] = int(own["context_window"])
        if "sample_timeout_s" in own:
            overrides["request_timeout_s"] = float(own["sample_timeout_s"])
        # The reply cap when a request names none: the agent's own cap, else the gateway's.
        cap = own.get("gateway_max_tokens", agent_kwargs.get("max_tokens_per_turn"))
        if cap is not None:
            overrides["max_tokens"] = int(cap)
        from oneloop.agents.gateway.server import GatewayConfig
        from oneloop.agents.gateway.sessions import SamplingDefaults

        self.config = GatewayConfig(
            tokenizer_path=own["tokenizer_path"], model_name=MODEL_NAME, max_sessions=1,
            defaults=SamplingDefaults(**overrides),
            template_kwargs=dict(own.get("template_kwargs") or {}),
        )  # fmt: skip
        self.session = trial_name.replace("/", "_")[:128]
        self.sampling_client = sampling_client
        self.gateway: Gateway | None = None
        # LiteLLM's OpenAI provider wants a key; the loopback gateway does not check it.
        self.env = {"OPENAI_API_KEY": "oneloop-gateway"}

    def start(self) -> dict[str, Any]:
        """Start the gateway and open the session; the agent kwargs pointing at it."""
        from oneloop.agents.gateway.server import Gateway

        self.gateway = Gateway(self.config).start()
        url = self.gateway.open_session(self.session, self.sampling_client)
        return {**self.agent_kwargs, "api_base": url}

    def finish(self, result: Any) -> None:
        """Put the session's trajectory (`tito`) and counters (`gateway`) into the Harbor
        `result`'s agent metadata.

        An agent that stopped because the gateway refused a prompt over the context window
        (terminus-2 raises ContextLengthExceededError, LiteLLM a BadRequestError) ran out of
        context: outcome `context_overflow` (the runner's truncation: reward 0, its tokens
        trained), not an infrastructure error, so the agent's exception is cleared.
        """
        if self.gateway is None or result.agent_result is None:
            return
        session = self.gateway.close_session(self.session)
        if session is None:
            return
        trajectories = session.trajectories()
        out = dict(result.agent_result.metadata or {})
        if trajectories:
            out["tito"] = trajectories[-1].to_json()
        counters = session.counters()
        out[METADATA_GATEWAY] = counters | {
            "segments": len(trajectories),
            "earlier_segments": [t.to_json() for t in trajectories[:-1]],
        }
        if counters["context_overflows"] and trajectories:
            out.setdefault("outcome", "context_overflow")
            if out["outcome"] == "context_overflow" and result.exception_info is not None:
                out["agent_exception"] = result.exception_info.exception_type
                result.exception_info = None
        result.agent_result.metadata = out

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
            self.gateway = None


def default_agent_import_path(kind: str, import_path: str | None) -> str:
    """The Harbor agent of `agent.kind` when `agent.import_path` is None: our MCP agent
    (`mcp`) or our LiteLLM tool agent (`openai_gateway`)."""
    if import_path is not None:
        return import_path
    if kind == "openai_gateway":
        from oneloop.agents.gateway.litellm_agent import LITELLM_AGENT_IMPORT_PATH

        return LITELLM_AGENT_IMPORT_PATH
    from oneloop.agents.mcp_agent import MCP_AGENT_IMPORT_PATH

    return MCP_AGENT_IMPORT_PATH
