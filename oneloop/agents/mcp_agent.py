"""The MCP tool-calling agent: a Harbor `BaseAgent` that samples raw tokens and keeps a TITO record.

This module owns `McpToolAgent` (loaded by Harbor through `MCP_AGENT_IMPORT_PATH`), its validated
kwargs (`McpAgentConfig`), the per-trial MCP connections (`McpToolbox`) and the episode loop
(`run_episode`): sample → parse → call tools (each with a timeout) → truncate each result
(head 2/3, tail 1/3, a marker naming the cut) → append the observation delta. Up to
`MAX_REPAIRS` repair messages answer unparsable tool calls; a context warning is appended once
when at most `CONTEXT_WARNING_FRACTION` of the window is left; each turn's `max_tokens` is
min(cap, context left). Outcomes (`AgentOutcome`): `finished` (a reply without tool calls),
`context_overflow`, `length_cap` (a per-turn cut without a usable tool call), `parse_errors`
(repairs exhausted), `max_turns`.

The sampling client comes from `oneloop.agents.registry` (`sampler_key`); only its Tinker `sample`
is used. All MCP sessions of a trial are opened and closed inside `run`, in the trial's task.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

from harbor.agents.base import BaseAgent
from harbor.agents.capabilities import AgentCapabilities
from harbor.models.agent.context import AgentContext
from harbor.models.agent.rollout_detail import RolloutDetail
from harbor.models.task.config import MCPServerConfig
from mcp import Client
from mcp.client.sse import sse_client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from tinker import types

import oneloop
from oneloop.agents.registry import get_sampler
from oneloop.agents.renderer import ChatRenderer
from oneloop.agents.tito import Trajectory
from oneloop.agents.tool_parsing import truncate_middle
from oneloop.errors import ConfigError, OneloopError

MCP_AGENT_IMPORT_PATH = "oneloop.agents.mcp_agent:McpToolAgent"
MAX_REPAIRS = 2
CONTEXT_WARNING_FRACTION = 0.2
REPAIR_MESSAGE = (
    "Your tool call could not be parsed ({reasons}). Write each call as <tool_call>"
    '{{"name": "<tool name>", "arguments": {{...}}}}</tool_call> with valid JSON, '
    "or answer without a tool call."
)
CONTEXT_WARNING = (
    "Context budget warning: about {left} of {window} tokens are left. "
    "Finish the task now with as few further tool calls as possible."
)
# Extra seconds the MCP request itself may wait past our own per-call timeout, so that our
# timeout (counted as a timeout) fires first and mcp's read timeout is only a backstop.
_MCP_READ_TIMEOUT_SLACK_S = 5.0


# Constructor kwargs Harbor itself passes to every agent; all other kwargs are ours and validated.
_HARBOR_INJECTED_KWARGS = frozenset((
    "extra_env", "base_url", "model_api_key_name", "model_api_format", "skip_model_parsing",
    "load_trajectory", "environment_logs_dir", "override_setup_timeout_sec",
))  # fmt: skip


class AgentOutcome(StrEnum):
    FINISHED = "finished"
    CONTEXT_OVERFLOW = "context_overflow"
    LENGTH_CAP = "length_cap"
    PARSE_ERRORS = "parse_errors"
    MAX_TURNS = "max_turns"


class McpConnectError(OneloopError, RuntimeError):
    """An MCP server could not be started, reached or listed (an infrastructure failure)."""


@dataclass(frozen=True)
class McpAgentConfig:
    """The agent's kwargs (Harbor `AgentConfig.kwargs`), validated."""

    sampler_key: str
    """Key of the sampling client in `oneloop.agents.registry` (string)."""
    tokenizer_path: str
    """Directory of the Hugging Face tokenizer with the chat template (path)."""
    max_turns: int = 16
    """Most sample calls in one episode (count)."""
    max_tokens_per_turn: int = 512
    """Cap on tokens sampled in one turn (tokens)."""
    context_window: int = 4096
    """Most tokens the whole trajectory may hold (tokens)."""
    tool_timeout_s: float = 30.0
    """Limit on one MCP tool call (seconds)."""
    tool_result_max_chars: int = 4000
    """Longest tool result shown to the model before head/tail truncation (characters)."""
    temperature: float = 1.0
    """Sampling temperature (unitless)."""
    top_p: float = 1.0
    """Nucleus sampling mass (probability)."""
    seed: int | None = None
    """Base sampling seed; turn t uses seed + t (integer or None for random)."""
    sampler_version: int | None = None
    """Weight version recorded when a sequence id does not carry one (integer)."""
    sample_timeout_s: float = 300.0
    """Limit on one sample request (seconds)."""
    connect_timeout_s: float = 30.0
    """Limit on starting/connecting one MCP server and listing its tools (seconds)."""
    system_prompt: str | None = None
    """System message placed before the instruction (text or None)."""
    stdio_on_host: bool = False
    """Run stdio MCP servers directly on the host when the environment cannot host them (flag)."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra chat-template variables, e.g. {"enable_thinking": false} (mapping)."""

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> McpAgentConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"agent.kwargs: unknown keys {unknown}; known keys: {sorted(names)}")
        for required in ("sampler_key", "tokenizer_path"):
            if not isinstance(kwargs.get(required), str) or not kwargs[required]:
                raise ConfigError(f"agent.kwargs.{required}: required non-empty string")
        config = cls(**kwargs)
        config._validate()
        return config

    def _validate(self) -> None:
        def check(name: str, ok: bool, what: str) -> None:
            if not ok:
                raise ConfigError(
                    f"agent.kwargs.{name}: must be {what}, got {getattr(self, name)!r}"
                )

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, int | float) and not isinstance(v, bool)

        for name in ("max_turns", "max_tokens_per_turn", "context_window", "tool_result_max_chars"):
            check(name, is_int(getattr(self, name)) and getattr(self, name) >= 1, "an integer >= 1")
        for name in ("tool_timeout_s", "sample_timeout_s", "connect_timeout_s"):
            check(name, is_num(getattr(self, name)) and getattr(self, name) > 0, "a number > 0")
        check("temperature", is_num(self.temperature) and self.temperature >= 0, "a number >= 0")
        check("top_p", is_num(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]")
        check("seed", self.seed is None or is_int(self.seed), "an integer or null")
        check("sampler_version", self.sampler_version is None or is_int(self.sampler_version),
              "an integer or null")  # fmt: skip
        check("system_prompt", self.system_prompt is None or isinstance(self.system_prompt, str),
              "a string or null")  # fmt: skip
        check("template_kwargs", isinstance(self.template_kwargs, dict), "a mapping")
        check("stdio_on_host", isinstance(self.stdio_on_host, bool), "a boolean")


@dataclass
class ToolStats:
    """Per-tool counters; a failure is an MCP `isError` result, an exception or a timeout."""

    calls: int = 0
    successes: int = 0
    failures: int = 0
    timeouts: int = 0


class McpToolbox:
    """The MCP sessions of one trial (one `Client` per server); enter it in the trial's task."""

    def __init__(
        self, servers: Sequence[MCPServerConfig], *, config: McpAgentConfig,
        stdio_command: Callable[[str, list[str]], tuple[str, list[str]]] | None = None,
        headers: Mapping[str, Mapping[str, str]] | None = None, stderr_dir: Path | None = None,
    ) -> None:  # fmt: skip
        self._servers = list(servers)
        self._config = config
        self._stdio_command = stdio_command
        self._headers = headers or {}
        self._stderr_dir = stderr_dir
        self._stack = contextlib.AsyncExitStack()
        self._routes: dict[str, Client] = {}
        self.specs: list[dict[str, Any]] = []
        self.stats: dict[str, ToolStats] = {}
        # One record per call, in call order (for diagnostics): tool, server, arguments, status
        # (ok | is_error | timeout | exception | unknown_tool), the result text the model saw
        # (before neutralising) and seconds.
        self.calls: list[dict[str, Any]] = []
        self._server_of: dict[str, str] = {}
        self.connect_sec = self.tool_sec = 0.0  # wall time spent connecting and in tool calls

    async def __aenter__(self) -> McpToolbox:
        try:
            for server in self._servers:
                await self._connect(server)
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def _connect(self, server: MCPServerConfig) -> None:
        timeout, started = self._config.connect_timeout_s, time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                client = Client(self._transport(server))
                await self._stack.enter_async_context(client)
                listed, cursor = [], None
                while True:
                    page = await client.list_tools(cursor=cursor)
                    listed.extend(page.tools)
                    if not (cursor := page.next_cursor):
                        break
        except TimeoutError as exc:
            raise McpConnectError(
                f"MCP server {server.name!r}: not connected and listed within {timeout} s"
            ) from exc
        except Exception as exc:  # spawn, transport, handshake or listing failed
            raise McpConnectError(
                f"MCP server {server.name!r}: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            self.connect_sec += time.monotonic() - started
        for tool in listed:
            if tool.name in self._routes:
                raise McpConnectError(
                    f"MCP server {server.name!r}: tool {tool.name!r} is offered by two servers"
                )
            self._routes[tool.name] = client
            self._server_of[tool.name] = server.name
            self.stats[tool.name] = ToolStats()
            function = {"name": tool.name, "description": tool.description or "",
                        "parameters": tool.input_schema}  # fmt: skip
            self.specs.append({"type": "function", "function": function})

    def _transport(self, server: MCPServerConfig) -> Any:
        if server.transport == "stdio":
            assert server.command is not None  # validated by MCPServerConfig
            command, args = server.command, list(server.args)
            if self._stdio_command is not None:
                command, args = self._stdio_command(command, args)
            elif not self._config.stdio_on_host:
                raise McpConnectError(
                    f"MCP server {server.name!r}: stdio servers need an environment with "
                    "stdio_command() (oneloop's NoContainerEnvironment) or agent.kwargs."
                    "stdio_on_host=true"
                )
            errlog = None
            if self._stderr_dir is not None:
                self._stderr_dir.mkdir(parents=True, exist_ok=True)
                path = self._stderr_dir / f"mcp-{server.name}.stderr.log"
                errlog = self._stack.enter_context(path.open("a"))
            params = StdioServerParameters(command=command, args=args)
            return stdio_client(params, errlog=errlog) if errlog else stdio_client(params)
        assert server.url is not None  # validated by MCPServerConfig
        headers = dict(self._headers.get(server.name, {}))
        if server.transport == "sse":
            return sse_client(server.url, headers=headers or None)
        http = create_mcp_http_client(headers=headers or None)
        self._stack.push_async_callback(http.aclose)
        return streamable_http_client(server.url, http_client=http)

    async def call(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """Call tool `name`; returns `(text for the model, success)` and counts the call."""
        started = time.monotonic()
        text, status = "", "exception"
        try:
            text, status = await self._call(name, arguments)
            return text, status == "ok"
        finally:
            seconds = time.monotonic() - started
            self.tool_sec += seconds
            shown = truncate_middle(text, self._config.tool_result_max_chars)
            self.calls.append({
                "tool": name, "server": self._server_of.get(name), "arguments": arguments,
                "status": status, "result": shown, "sec": seconds,
            })  # fmt: skip

    async def _call(self, name: str, arguments: dict[str, Any]) -> tuple[str, str]:
        stats = self.stats.setdefault(name, ToolStats())
        stats.calls += 1
        client = self._routes.get(name)
        if client is None:
            stats.failures += 1
            known = sorted(self._routes)
            return f"Error: unknown tool {name!r}; available tools: {known}", "unknown_tool"
        timeout = self._config.tool_timeout_s
        try:
            async with asyncio.timeout(timeout):
                result = await client.call_tool(
                    name, arguments, read_timeout_seconds=timeout + _MCP_READ_TIMEOUT_SLACK_S
                )
        except TimeoutError:
            stats.failures += 1
            stats.timeouts += 1
            return f"Error: tool {name!r} did not finish within {timeout} s", "timeout"
        except Exception as exc:  # an MCP error, a broken pipe: a failed call, told to the model
            stats.failures += 1
            return f"Error: tool {name!r} failed: {type(exc).__name__}: {exc}", "exception"
        text = _result_text(result)
        if result.is_error:
            stats.failures += 1
            return (text if text.startswith("Error") else f"Error: {text}"), "is_error"
        stats.successes += 1
        return text, "ok"


def _result_text(result: Any) -> str:
    parts: list[str] = []
    for item in result.content:
        text = getattr(item, "text", None)
        parts.append(text if isinstance(text, str) else f"[{item.type} content omitted]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


@dataclass(frozen=True)
class TurnRecord:
    """One sample call: its prompt's length and `max_tokens` (its reply is the trajectory's
    sampled segment of the same index)."""

    prompt_length: int
    max_tokens: int
    sample_sec: float


@dataclass(frozen=True)
class Episode:
    """What one `run_episode` produced."""

    outcome: AgentOutcome
    trajectory: Trajectory
    turns: tuple[TurnRecord, ...]
    repairs: int
    context_warnings: int


async def run_episode(
    *, sampler: Any, renderer: ChatRenderer, toolbox: McpToolbox, instruction: str,
    config: McpAgentConfig,
    on_turn: Callable[[Trajectory, Sequence[TurnRecord]], None] | None = None,
) -> Episode:  # fmt: skip
    """Run the sample → tools → observation loop until an outcome; see the module docstring."""
    messages: list[dict[str, Any]] = []
    if config.system_prompt is not None:
        messages.append({"role": "system", "content": config.system_prompt})
    messages.append({"role": "user", "content": instruction})
    trajectory = Trajectory.start(renderer.initial_prompt(messages, toolbox.specs or None))
    turns: list[TurnRecord] = []
    repairs = warnings = 0
    outcome = AgentOutcome.MAX_TURNS
    for turn in range(config.max_turns):
        left = config.context_window - trajectory.length
        if left < 1:
            outcome = AgentOutcome.CONTEXT_OVERFLOW
            break
        max_tokens = min(config.max_tokens_per_turn, left)
        prompt = trajectory.model_input()
        params = types.SamplingParams(
            max_tokens=max_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            seed=None if config.seed is None else config.seed + turn,
            stop=list(renderer.stop_token_ids),
        )
        started = time.monotonic()
        sequence = await _sample_one(sampler, prompt, params, config)
        trajectory = trajectory.append_sampled(
            sequence, prompt=prompt, fallback_version=config.sampler_version
        )
        tokens = trajectory.segments[-1].tokens
        turns.append(TurnRecord(prompt.length, max_tokens, time.monotonic() - started))
        if on_turn is not None:
            on_turn(trajectory, turns)
        stopped = renderer.ends_with_stop(tokens)
        reply = renderer.parse_reply(tokens)
        if not stopped and (reply.errors or not reply.tool_calls):
            full = trajectory.length >= config.context_window
            outcome = AgentOutcome.CONTEXT_OVERFLOW if full else AgentOutcome.LENGTH_CAP
            break
        if reply.errors:
            repairs += 1
            if repairs > MAX_REPAIRS:
                outcome = AgentOutcome.PARSE_ERRORS
                break
            reasons = "; ".join(e.reason for e in reply.errors)
            observation = [{"role": "user", "content": REPAIR_MESSAGE.format(reasons=reasons)}]
        elif not reply.tool_calls:
            outcome = AgentOutcome.FINISHED
            break
        else:
            observation = []
            for index, call in enumerate(reply.tool_calls):
                text, _ = await toolbox.call(call.name, call.arguments)
                content = truncate_middle(renderer.neutralize(text), config.tool_result_max_chars)
                observation.append({"role": "tool", "tool_call_id": f"call_{turn}_{index}",
                                    "name": call.name, "content": content})  # fmt: skip
        delta = renderer.observation_delta(observation, after_stop_token=stopped)
        remaining = config.context_window - trajectory.length - len(delta)
        if warnings == 0 and remaining <= CONTEXT_WARNING_FRACTION * config.context_window:
            warning = CONTEXT_WARNING.format(left=max(remaining, 0), window=config.context_window)
            observation.append({"role": "user", "content": warning})
            delta = renderer.observation_delta(observation, after_stop_token=stopped)
            warnings += 1
        if trajectory.length + len(delta) >= config.context_window:
            outcome = AgentOutcome.CONTEXT_OVERFLOW
            break
        trajectory = trajectory.append_observation(delta)
    return Episode(outcome, trajectory, tuple(turns), repairs, warnings)


async def _sample_one(
    sampler: Any, prompt: types.ModelInput, params: types.SamplingParams, config: McpAgentConfig
) -> types.SampledSequence:
    try:
        async with asyncio.timeout(config.sample_timeout_s):
            response = await sampler.sample(prompt, 1, params)  # an APIFuture is awaitable
    except TimeoutError as exc:
        raise TimeoutError(
            f"sampler {config.sampler_key!r} did not answer within {config.sample_timeout_s} s "
            "(agent.kwargs.sample_timeout_s)"
        ) from exc
    if not response.sequences:
        raise OneloopError(f"sampler {config.sampler_key!r} returned no sequences")
    return response.sequences[0]


class McpToolAgent(BaseAgent):
    """Harbor agent: the TITO MCP tool loop above, configured by `McpAgentConfig` kwargs."""

    capabilities: ClassVar[AgentCapabilities] = AgentCapabilities(mcp_servers=True)

    def __init__(
        self, logs_dir: Path, model_name: str | None = None, logger: Any = None,
        mcp_servers: list[MCPServerConfig] | None = None, skills_dir: str | None = None,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        own = {k: kwargs.pop(k) for k in list(kwargs) if k not in _HARBOR_INJECTED_KWARGS}
        super().__init__(logs_dir, model_name, logger, mcp_servers, skills_dir, **kwargs)
        self.config = McpAgentConfig.from_kwargs(own)

    @staticmethod
    def name() -> str:
        return "oneloop-mcp-tool-agent"

    def version(self) -> str | None:
        return oneloop.__version__

    async def setup(self, environment: Any) -> None:
        """Nothing to install: MCP sessions are opened in `run`, in the trial's own task."""

    async def run(self, instruction: str, environment: Any, context: AgentContext) -> None:
        sampler = get_sampler(self.config.sampler_key)
        renderer = ChatRenderer.from_pretrained(
            self.config.tokenizer_path, template_kwargs=self.config.template_kwargs
        )
        headers = {
            server: {name: self.mcp_header_env.env[var] for name, var in refs.items()}
            for server, refs in self.mcp_header_env.refs.items()
        }
        toolbox = McpToolbox(
            self.mcp_servers,
            config=self.config,
            stdio_command=getattr(environment, "stdio_command", None),
            headers=headers,
            stderr_dir=self.logs_dir,
        )
        context.metadata = {"outcome": None, "sampler_key": self.config.sampler_key}
        fill = ContextFiller(context, toolbox)
        async with toolbox:
            episode = await run_episode(
                sampler=sampler,
                renderer=renderer,
                toolbox=toolbox,
                instruction=instruction,
                config=self.config,
                on_turn=fill,
            )
        fill(episode.trajectory, episode.turns)
        context.metadata = (context.metadata or {}) | {
            "outcome": episode.outcome.value,
            "repairs": episode.repairs,
            "context_warnings": episode.context_warnings,
        }


class ContextFiller:
    """Token counts, per-turn rollout details, tool counters and the TITO trajectory so far,
    written into Harbor's AgentContext after every sample (so a trial cut by Harbor's timeout
    still reports them). Per-turn token lists are kept and only new turns are added: rebuilding
    them each turn cost O(turns² × tokens) over an episode."""

    def __init__(self, context: AgentContext, toolbox: McpToolbox) -> None:
        self.context = context
        self.toolbox = toolbox
        self.prompts: list[list[int]] = []
        self.completions: list[list[int]] = []
        self.logprobs: list[list[float]] = []

    def __call__(self, trajectory: Trajectory, turns: Sequence[TurnRecord]) -> None:
        tokens = trajectory.tokens
        sampled = trajectory.sampled_segments
        self.prompts += [list(tokens[: t.prompt_length]) for t in turns[len(self.prompts) :]]
        for segment in sampled[len(self.completions) :]:
            self.completions.append(list(segment.tokens))
            self.logprobs.append(list(segment.logprobs or ()))
        context, toolbox = self.context, self.toolbox
        context.n_input_tokens = sum(t.prompt_length for t in turns)
        context.n_output_tokens = sum(len(s) for s in self.completions)
        context.rollout_details = [
            RolloutDetail(
                prompt_token_ids=list(self.prompts),
                completion_token_ids=list(self.completions),
                logprobs=list(self.logprobs),
            )
        ]
        timings = {"llm_sec": sum(t.sample_sec for t in turns), "tool_sec": toolbox.tool_sec}
        context.metadata = (context.metadata or {}) | {
            "turns": len(turns),
            "tool_stats": {name: asdict(stats) for name, stats in toolbox.stats.items()},
            "tool_calls": list(toolbox.calls),
            "timings": timings | {"mcp_connect_sec": toolbox.connect_sec},
            "tito": trajectory.to_json(),
        }
