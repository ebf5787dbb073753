"""Sessions and TITO accounting: which tokens each OpenAI request really sent and sampled.

This module owns `Session` (one agent's conversation: the token trajectory it has built, the
candidate replies of its last request, its finished segments and counters) and `SessionStore`
(ids → sessions, idle expiry, a cap on live sessions).

Accounting contract, per session:
* a chat request whose messages are the previous request's messages, then one of the replies
  the gateway returned for it (compared by `render.message_key`), then new non-assistant
  messages (tool results, user notes) *continues* the trajectory: only those new messages are
  rendered, as a `ChatRenderer.observation_delta`, and appended after the reply's exact sampled
  tokens; nothing already in the trajectory is re-tokenised;
* any other request (an agent that summarises, edits or drops earlier turns, changes the tools,
  or starts over) closes the current segment and starts a new one from a fresh render; this is
  counted (`new_segments`, `history_rewrites`) and never merged into the old segment;
* `/v1/completions` continues when the prompt's token ids extend a reply's trajectory exactly
  (a text prompt is encoded first, so a re-tokenisation that differs is a new segment, counted);
* with `n > 1` the continuation follows the choice the client echoes back; the others are
  counted (`unchosen_choices`) and not trained on.
`trajectories()` gives the finished segments and the current one (choice 0 of the last request
when the client never continued it), each a `Trajectory` the loop trains on unchanged.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tinker import types

from oneloop.agents.gateway.render import (
    Reply,
    cut_at_stop,
    message_key,
    reply_message,
    template_messages,
)
from oneloop.agents.gateway.wire import ChatRequest, CompletionRequest, GatewayHttpError
from oneloop.agents.renderer import ChatRenderer
from oneloop.agents.tito import Trajectory

COUNTER_KEYS = (
    "requests", "continued", "new_segments", "history_rewrites", "unchosen_choices",
    "prompt_tokens", "sampled_tokens", "observation_tokens", "sample_timeouts", "sample_errors",
    "context_overflows",
)  # fmt: skip


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request leaves out, and the limits every request of a session obeys."""

    context_window: int = 4096  # tokens one trajectory may hold
    max_tokens: int = 512  # tokens per reply when the request names none
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None  # request k of a session samples with seed + k (None: random)
    sampler_version: int | None = None  # recorded when a sequence id carries no version
    request_timeout_s: float = 300.0  # one sample call


@dataclass(frozen=True)
class Choice:
    trajectory: Trajectory  # up to and including this choice's sampled tokens
    reply: Reply
    stopped: bool  # the sampled tokens end with a stop token


@dataclass(frozen=True)
class Sampled:
    """One request's answer: its prompt's length and one `Choice` per sample."""

    prompt_length: int
    choices: tuple[Choice, ...]
    continued: bool


@dataclass
class Session:
    """One conversation's TITO record; see the module docstring. Not thread-safe: a session
    is used from the gateway's event loop only, one request at a time (`lock`)."""

    session_id: str
    sampler: Any
    renderer: ChatRenderer
    defaults: SamplingDefaults
    clock: Callable[[], float] = time.monotonic
    segments: list[Trajectory] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = 0.0
    _choices: tuple[Choice, ...] = ()
    _history: tuple[Any, ...] = ()  # message keys of the last request (chat)
    _tools_key: str | None = None  # the last request's tools; None after a completion
    _adopted: Choice | None = None  # the choice the conversation continued from

    def __post_init__(self) -> None:
        self.last_used = self.clock()

    # -- planning: which prompt a request sends ----------------------------------------------

    def _new_segment(self) -> None:
        if self._choices or self._adopted is not None:
            self.segments.append(self._current().trajectory)
            self.counts["history_rewrites"] += 1
        self.counts["new_segments"] += 1
        self._choices, self._adopted = (), None

    def _current(self) -> Choice:
        return self._choices[0] if self._choices else self._adopted  # type: ignore[return-value]

    def _continue(self, choice: Choice) -> None:
        self.counts["continued"] += 1
        self.counts["unchosen_choices"] += len(self._choices) - 1
        self._choices, self._adopted = (), choice

    def plan_chat(self, request: ChatRequest) -> tuple[Trajectory, bool]:
        """The trajectory the request's prompt is (continued, or a new segment) and whether it
        continued; renders only what is new."""
        keys = tuple(message_key(m) for m in request.messages)
        tools = [t.model_dump(exclude_none=True) for t in request.tools or ()]
        tools_key = json.dumps(tools, sort_keys=True)
        k = len(self._history)
        if self._choices and tools_key == self._tools_key and len(keys) > k + 1:
            match = next((c for c in self._choices if c.reply.key == keys[k]), None)
            new = request.messages[k + 1 :]
            if (match is not None and keys[:k] == self._history
                    and all(m.role != "assistant" for m in new)):  # fmt: skip
                delta = self.renderer.observation_delta(
                    template_messages(new, self.renderer, offset=k + 1),
                    after_stop_token=match.stopped,
                )
                self._continue(match)
                self._history, self._tools_key = keys, tools_key
                self.counts["observation_tokens"] += len(delta)
                return match.trajectory.append_observation(delta), True
        prompt = self.renderer.initial_prompt(
            template_messages(request.messages, self.renderer), tools or None
        )
        self._new_segment()
        self._history, self._tools_key = keys, tools_key
        return Trajectory.start(prompt), False

    def plan_completion(self, request: CompletionRequest) -> tuple[Trajectory, bool]:
        """As `plan_chat` for a raw prompt: continued when its ids extend a reply exactly."""
        if isinstance(request.prompt, str):
            ids = self.renderer.encode(request.prompt)
        else:
            ids = list(request.prompt)
        if not ids:
            raise GatewayHttpError(400, "prompt: encodes to no tokens", param="prompt")
        if self._choices and self._tools_key is None:
            for choice in self._choices:
                mine = choice.trajectory.tokens
                if len(ids) > len(mine) and ids[: len(mine)] == mine:
                    self._continue(choice)
                    self.counts["observation_tokens"] += len(ids) - len(mine)
                    return choice.trajectory.append_observation(ids[len(mine) :]), True
        self._new_segment()
        self._history, self._tools_key = (), None
        return Trajectory.start(ids), False

    # -- sampling --------------------------------------------------------------------------

    def params(self, request: ChatRequest | CompletionRequest, length: int) -> types.SamplingParams:
        d = self.defaults
        left = d.context_window - length
        if left < 1:
            self.counts["context_overflows"] += 1
            raise GatewayHttpError(
                400, f"messages: the prompt holds {length} tokens, the context window "
                f"{d.context_window}", param="messages", code="context_length_exceeded",
            )  # fmt: skip
        seed = request.seed
        if seed is None and d.seed is not None:
            seed = d.seed + self.counts["requests"]  # request k of the session: seed + k
        return types.SamplingParams(
            max_tokens=min(request.token_limit or d.max_tokens, left),
            temperature=d.temperature if request.temperature is None else request.temperature,
            top_p=d.top_p if request.top_p is None else request.top_p,
            seed=seed,
            stop=list(self.renderer.stop_token_ids),
        )

    async def sample(
        self, request: ChatRequest | CompletionRequest, base: Trajectory, continued: bool,
        *, tools_offered: bool,
    ) -> Sampled:  # fmt: skip
        """Sample `request.n` replies to `base` and record them as the session's choices."""
        params = self.params(request, base.length)
        self.counts["requests"] += 1  # sampled requests (a refused one counts apart)
        prompt = base.model_input()
        timeout = self.defaults.request_timeout_s
        try:
            async with asyncio.timeout(timeout):
                response = await self.sampler.sample(prompt, request.n, params)
        except TimeoutError:
            self.counts["sample_timeouts"] += 1
            raise GatewayHttpError(
                504, f"the sampler did not answer within {timeout} s (request_timeout_s)",
                kind="timeout", code="timeout",
            ) from None  # fmt: skip
        except GatewayHttpError:
            raise
        except Exception as exc:  # a backend error: the client sees a 502 naming it
            self.counts["sample_errors"] += 1
            raise GatewayHttpError(
                502, f"sampler failed: {type(exc).__name__}: {exc}", kind="server_error"
            ) from exc
        if len(response.sequences) != request.n:
            self.counts["sample_errors"] += 1
            raise GatewayHttpError(
                502, f"sampler returned {len(response.sequences)} sequences for n={request.n}",
                kind="server_error",
            )  # fmt: skip
        stops = request.stop or []
        choices = []
        for sequence in response.sequences:
            cut = cut_at_stop(self.renderer, sequence.tokens, stops)
            if cut is not None:
                sequence = _prefix(sequence, cut)
            trajectory = base.append_sampled(
                sequence, prompt=prompt, fallback_version=self.defaults.sampler_version
            )
            tokens = trajectory.segments[-1].tokens
            reply = reply_message(
                self.renderer, tokens, stops=stops, cut=cut is not None,
                tools_offered=tools_offered,
            )  # fmt: skip
            choices.append(Choice(trajectory, reply, self.renderer.ends_with_stop(tokens)))
            self.counts["sampled_tokens"] += len(tokens)
        self.counts["prompt_tokens"] += base.length
        self._choices = tuple(choices)
        self.last_used = self.clock()
        return Sampled(base.length, self._choices, continued)

    # -- results ---------------------------------------------------------------------------

    def trajectories(self) -> list[Trajectory]:
        """Finished segments, then the current one (if any request was answered)."""
        current = self._current() if (self._choices or self._adopted) else None
        return [*self.segments, *([current.trajectory] if current is not None else [])]

    def counters(self) -> dict[str, int]:
        return {key: self.counts[key] for key in COUNTER_KEYS}


def _prefix(sequence: types.SampledSequence, length: int) -> types.SampledSequence:
    """The first `length` tokens of `sequence` with their logprobs and its id (version)."""
    logprobs = sequence.logprobs
    if logprobs is None:
        raise GatewayHttpError(502, "the sampler returned no logprobs", kind="server_error")
    return types.SampledSequence(
        stop_reason="stop",
        sequence_id=sequence.sequence_id,
        tokens_np=np.asarray(sequence.tokens[:length], dtype=np.int32),
        logprobs_np=np.asarray(logprobs[:length], dtype=np.float32),
    )


class SessionStore:
    """Live sessions by id, each idle at most `ttl_s`, at most `max_sessions` at once."""

    def __init__(
        self, renderer: ChatRenderer, defaults: SamplingDefaults, *, max_sessions: int,
        ttl_s: float, sampler: Any = None, clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.renderer = renderer
        self.defaults = defaults
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.sampler = sampler  # for sessions a request opens (the CLI's); None: open() only
        self.clock = clock
        self.sessions: dict[str, Session] = {}
        self.counts: Counter[str] = Counter()

    def expire(self) -> None:
        now = self.clock()
        for key in [k for k, s in self.sessions.items() if now - s.last_used > self.ttl_s]:
            if not self.sessions[key].lock.locked():
                del self.sessions[key]
                self.counts["sessions_expired"] += 1

    def open(self, session_id: str, sampler: Any = None, **overrides: Any) -> Session:
        """A new session `session_id` sampling from `sampler` (default: the store's)."""
        self.expire()
        if session_id in self.sessions:
            raise GatewayHttpError(409, f"session {session_id!r} already exists", param="session")
        if len(self.sessions) >= self.max_sessions:
            self.counts["sessions_refused"] += 1
            raise GatewayHttpError(
                429, f"{len(self.sessions)} sessions are live, the cap is {self.max_sessions} "
                "(max_sessions); close or let sessions expire", kind="rate_limit_error",
                code="too_many_sessions",
            )  # fmt: skip
        sampler = sampler if sampler is not None else self.sampler
        if sampler is None:
            raise GatewayHttpError(
                404, f"session {session_id!r} is not open (this gateway opens sessions only "
                "for its trial runner)", param="session", code="session_not_found",
            )  # fmt: skip
        defaults = _override(self.defaults, overrides)
        session = Session(session_id, sampler, self.renderer, defaults, clock=self.clock)
        self.sessions[session_id] = session
        self.counts["sessions_opened"] += 1
        return session

    def get(self, session_id: str) -> Session:
        """The live session, opening it when the store has a default sampler."""
        self.expire()
        session = self.sessions.get(session_id)
        return session if session is not None else self.open(session_id)

    def close(self, session_id: str) -> Session | None:
        session = self.sessions.pop(session_id, None)
        if session is not None:
            self.counts["sessions_closed"] += 1
        return session


def _override(defaults: SamplingDefaults, overrides: dict[str, Any]) -> SamplingDefaults:
    from dataclasses import replace

    return replace(defaults, **overrides) if overrides else defaults


def sequence_lists(choices: Sequence[Choice]) -> list[list[int]]:
    """Each choice's sampled token ids."""
    return [list(c.trajectory.segments[-1].tokens) for c in choices]
