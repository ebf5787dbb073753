"""A minimal Harbor agent that reaches its model only through LiteLLM's OpenAI client.

This module owns `LiteLlmToolAgent`: the smallest agent of the kind most Harbor agents are (text
in, text out over `/chat/completions`), used to train through the gateway when no stock Harbor
agent can run here (terminus-2 drives a tmux pane and expects a container). It offers the task's
MCP tools as OpenAI `tools` (connections reuse `McpToolbox`), sends `litellm.acompletion` to
`api_base`, runs the returned `tool_calls`, appends the results as `tool` messages, and stops on
a reply without tool calls. It knows nothing about tokens: the gateway keeps them.
Outcomes in `AgentContext.metadata["outcome"]`: `finished`, `length_cap`, `max_turns`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, ClassVar

from harbor.agents.base import BaseAgent
from harbor.agents.capabilities import AgentCapabilities
from harbor.models.agent.context import AgentContext
from harbor.models.task.config import MCPServerConfig

import oneloop
from oneloop.agents.mcp_agent import McpAgentConfig, McpToolbox
from oneloop.agents.tool_parsing import truncate_middle
from oneloop.errors import ConfigError

LITELLM_AGENT_IMPORT_PATH = "oneloop.agents.gateway.litellm_agent:LiteLlmToolAgent"
_OWN_KWARGS = {
    "api_base": str, "api_key": str, "max_turns": int, "max_tokens_per_turn": int,
    "temperature": float, "top_p": float, "tool_timeout_s": float, "tool_result_max_chars": int,
    "system_prompt": (str, type(None)), "stdio_on_host": bool, "request_timeout_s": float,
}  # fmt: skip


class LiteLlmToolAgent(BaseAgent):
    """Harbor agent: MCP tools offered to an OpenAI-compatible endpoint through LiteLLM."""

    capabilities: ClassVar[AgentCapabilities] = AgentCapabilities(mcp_servers=True)

    def __init__(
        self, logs_dir: Path, model_name: str | None = None, logger: Any = None,
        mcp_servers: list[MCPServerConfig] | None = None, skills_dir: str | None = None,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        own = {k: kwargs.pop(k) for k in list(kwargs) if k in _OWN_KWARGS}
        unknown = sorted(k for k in kwargs if k not in _HARBOR_KWARGS)
        if unknown:
            raise ConfigError(f"agent.kwargs: unknown keys {unknown}; known: {sorted(_OWN_KWARGS)}")
        super().__init__(logs_dir, model_name, logger, mcp_servers, skills_dir, **kwargs)
        for key, value in own.items():
            kind = _OWN_KWARGS[key]
            if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
                if not (kind is float and isinstance(value, int) and not isinstance(value, bool)):
                    raise ConfigError(f"agent.kwargs.{key}: expected {kind}, got {value!r}")
        if "api_base" not in own or not model_name:
            raise ConfigError("agent.kwargs.api_base and agent.model_name are required")
        self.own = own

    @staticmethod
    def name() -> str:
        return "oneloop-litellm-tool-agent"

    def version(self) -> str | None:
        return oneloop.__version__

    async def setup(self, environment: Any) -> None:
        """Nothing to install."""

    async def run(self, instruction: str, environment: Any, context: AgentContext) -> None:
        import litellm

        own = self.own
        tools_config = McpAgentConfig(
            sampler_key="-", tokenizer_path="-",
            tool_timeout_s=own.get("tool_timeout_s", 30.0),
            tool_result_max_chars=own.get("tool_result_max_chars", 4000),
            stdio_on_host=own.get("stdio_on_host", False),
        )  # fmt: skip
        toolbox = McpToolbox(
            self.mcp_servers, config=tools_config,
            stdio_command=getattr(environment, "stdio_command", None), stderr_dir=self.logs_dir,
        )  # fmt: skip
        messages: list[dict[str, Any]] = []
        if own.get("system_prompt"):
            messages.append({"role": "system", "content": own["system_prompt"]})
        messages.append({"role": "user", "content": instruction})
        outcome, turns, llm_sec = "max_turns", 0, 0.0
        async with toolbox:
            for _ in range(own.get("max_turns", 8)):
                started = time.monotonic()
                response = await litellm.acompletion(
                    model=self.model_name, api_base=own["api_base"],
                    api_key=own.get("api_key") or self._extra_env.get("OPENAI_API_KEY"),
                    messages=messages,
                    tools=toolbox.specs or None, max_tokens=own.get("max_tokens_per_turn", 256),
                    temperature=own.get("temperature", 1.0), top_p=own.get("top_p", 1.0),
                    timeout=own.get("request_timeout_s", 300.0), num_retries=0,
                )  # fmt: skip
                llm_sec += time.monotonic() - started
                turns += 1
                choice = response.choices[0]
                message = choice.message.model_dump(exclude_none=True)
                messages.append(message)
                calls = message.get("tool_calls") or []
                if not calls:
                    outcome = "length_cap" if choice.finish_reason == "length" else "finished"
                    break
                for call in calls:
                    try:
                        arguments = json.loads(call["function"]["arguments"] or "{}")
                    except json.JSONDecodeError:
                        arguments = {}
                    text, _ = await toolbox.call(call["function"]["name"], arguments)
                    limit = own.get("tool_result_max_chars", 4000)
                    messages.append({"role": "tool", "tool_call_id": call["id"],
                                     "content": truncate_middle(text, limit)})  # fmt: skip
        context.metadata = {
            "outcome": outcome,
            "turns": turns,
            "timings": {"llm_sec": llm_sec, "tool_sec": toolbox.tool_sec,
                        "mcp_connect_sec": toolbox.connect_sec},
        }  # fmt: skip


# Constructor kwargs Harbor itself passes to every agent.
_HARBOR_KWARGS = frozenset((
    "extra_env", "base_url", "model_api_key_name", "model_api_format", "skip_model_parsing",
    "load_trajectory", "environment_logs_dir", "override_setup_timeout_sec",
))  # fmt: skip
