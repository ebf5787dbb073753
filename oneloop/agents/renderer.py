"""Chat-template rendering for TITO agents, for any Hugging Face tokenizer with a `chat_template`.

This module owns `ChatRenderer`: the initial prompt ids (system + tools + user, with the generation
prompt), observation deltas, the stop tokens and the parsing of sampled replies; and, for SFT, a
whole conversation laid out the same way (`conversation_tokens`: assistant turns as the model
samples them, observations as the agent appends them).

Observation deltas are rendered against a FIXED base conversation, never against the real history,
so earlier turns are never re-rendered (templates such as Qwen3's render a past assistant turn
differently from the last one, and re-rendering would change tokens the sampler already saw).
The delta is what the template writes after an assistant stub's end-of-turn: we render
`[base..., {assistant: SENTINEL}, new messages...]` with the generation prompt and cut the text
right after the first stop string that follows the sentinel. When the sampled reply already ended
with a stop token (ChatML: the model wrote `<|im_end|>`, the template would add `<|im_end|>\\n`),
the delta starts right after it (the `\\n`); when the reply was cut by a length limit, the delta
also carries the template's end-of-turn text. Cutting after a control token keeps tokenisation
exact: fast tokenizers split added tokens first, so the delta's tokens are exactly the tokens a
full render adds after the assistant's stop token (checked by property tests on the tiny model's
template and on the real Qwen3 template).

Why not a package: `tml-renderers` ships hand-written renderers for named model families with its
own tokenizers (no Hugging Face templates); `renderers`' generic `DefaultRenderer` has no
incremental bridge (`bridge_to_next_turn` returns None, i.e. a full re-render) and pulls in
openai/harmony/tiktoken.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from oneloop.agents.tool_parsing import ParsedReply, parse_hermes
from oneloop.errors import OneloopError

# End-of-turn markers of common chat formats; a stop token only if the tokenizer has it as one
# token and the template writes it (ChatML, Llama 3, Phi-3, Gemma).
KNOWN_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
# Stands in for the sampled reply when rendering observation deltas; plain ASCII so that no
# template trims or escapes it.
DELTA_SENTINEL = "ONELOOP_DELTA_SENTINEL_7c1f"
# Breaks a control-token string in untrusted text (see `ChatRenderer.neutralize`).
ZERO_WIDTH_SPACE = "\u200b"
DEFAULT_DELTA_BASE: tuple[Mapping[str, Any], ...] = (
    {"role": "system", "content": "base"},
    {"role": "user", "content": "base"},
)

Message = Mapping[str, Any]


class RendererError(OneloopError, ValueError):
    """The tokenizer or chat template cannot be used the way TITO needs; the message says why."""


class ChatRenderer:
    """Renders conversations to token ids with a tokenizer's chat template and parses replies.

    `tokenizer` is a Hugging Face tokenizer with a non-empty `chat_template`. `template_kwargs`
    (e.g. `{"enable_thinking": False}`) are passed to every render. `stop_tokens` overrides the
    detected stop strings (eos plus known end-of-turn tokens the template writes).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
        stop_tokens: Sequence[str] | None = None,
        delta_base: Sequence[Message] = DEFAULT_DELTA_BASE,
    ) -> None:
        template = getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str) or not template.strip():
            raise RendererError(
                "tokenizer.chat_template: the tokenizer has no chat template; attach one "
                "(tokenizer.chat_template = '...') or load a chat model's tokenizer"
            )
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self._delta_base = [dict(m) for m in delta_base]
        self.stop_strings = self._resolve_stop_strings(template, stop_tokens)
        self.stop_token_ids = tuple(self._single_token_id(s) for s in self.stop_strings)
        self._stop_id_set = frozenset(self.stop_token_ids)
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.control_strings = tuple(
            sorted({t.content for t in decoder.values() if t.special} | set(self.stop_strings))
        )
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # The Rust tokenizer directly when there is one: same ids, far less per-call overhead;
        # `encode_batch_fast` skips offset tracking (about 1.5x faster on long tool results).
        self._encode_fast = None
        if backend is not None and hasattr(backend, "encode_batch_fast"):
            self._encode_fast = lambda text: (
                backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
            )
        elif backend is not None:
            self._encode_fast = lambda text: backend.encode(text, add_special_tokens=False).ids

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: Any) -> ChatRenderer:
        """A renderer for the tokenizer saved at `path` (loaded once per process)."""
        return cls(_load_tokenizer(str(path)), **kwargs)

    # -- rendering ------------------------------------------------------------------------------

    def render_text(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        """The template's text for `messages` (OpenAI-shaped dicts)."""
        return self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=[dict(t) for t in tools] if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` with no special tokens added (as `apply_chat_template` does)."""
        if self._encode_fast is not None:
            return self._encode_fast(text)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, tokens: Sequence[int]) -> str:
        """Text of `tokens`, control tokens kept."""
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False)

    def initial_prompt(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """Prompt ids for the first sample: `messages` (system, user...) and `tools`, plus the
        generation prompt."""
        if not messages:
            raise RendererError("messages: the initial prompt needs at least one message")
        tokens = self.encode(self.render_text(messages, tools=tools, add_generation_prompt=True))
        if not tokens:
            raise RendererError("messages: the chat template rendered an empty prompt")
        return tokens

    def observation_delta(
        self, messages: Sequence[Message], *, after_stop_token: bool = True
    ) -> list[int]:
        """Tokens to append after a sampled reply: `messages` (tool results, user notes) and the
        next generation prompt.

        `after_stop_token` says whether the sampled reply ended with one of `stop_token_ids`;
        if not (a length cut), the delta starts with the template's end of the assistant turn.
        """
        if not messages:
            raise RendererError("messages: an observation needs at least one message")
        conversation = [
            *self._delta_base,
            {"role": "assistant", "content": DELTA_SENTINEL},
            *(dict(m) for m in messages),
        ]
        text = self.render_text(conversation, add_generation_prompt=True)
        at = text.find(DELTA_SENTINEL)
        if at < 0 or text.find(DELTA_SENTINEL, at + 1) >= 0:
            raise RendererError(
                "chat_template: the assistant stub must appear exactly once in the render; "
                "this template rewrites assistant content and cannot be used for deltas"
            )
        rest = text[at + len(DELTA_SENTINEL) :]
        if after_stop_token:
            found = [(rest.find(s), s) for s in self.stop_strings if s in rest]
            if not found:
                raise RendererError(
                    f"chat_template: no stop token {list(self.stop_strings)} closes the "
                    "assistant turn; pass stop_tokens= naming the template's end-of-turn token"
                )
            position, stop = min(found)
            rest = rest[position + len(stop) :]
        return self.encode(rest)

    def assistant_turn(
        self,
        history: Sequence[Message],
        reply: Message,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """The tokens a model samples for `reply` after `history`: what the template writes after
        the generation prompt, up to and including the first stop token (an SFT target)."""
        before = self.render_text(history, tools=tools, add_generation_prompt=True)
        after = self.render_text([*history, reply], tools=tools)
        if not after.startswith(before):
            raise RendererError(
                "chat_template: an assistant turn does not extend the generation prompt"
            )
        text = after[len(before) :]
        stops = [(text.find(s), s) for s in self.stop_strings if s in text]
        if not stops:
            raise RendererError("chat_template: the assistant turn has no stop token")
        position, stop = min(stops)
        return self.encode(text[: position + len(stop)])

    def conversation_tokens(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> tuple[list[int], list[float]]:
        """Token ids of a whole conversation laid out the way the agent builds a trajectory, and
        weights: 1 on the assistant turns (their stop token included), 0 elsewhere.

        The messages before the first assistant turn are the initial prompt (`initial_prompt`,
        with `tools`); each assistant turn is `assistant_turn`; the messages between two assistant
        turns (tool results, user notes) are one `observation_delta` after the stop token, tool
        results neutralised as the agent does. A layout the agent never builds (no prompt before
        the first assistant turn, two assistant turns in a row, no assistant turn last) raises
        RendererError.
        """
        roles = [m.get("role") for m in messages]
        if "assistant" not in roles or roles[0] == "assistant" or roles[-1] != "assistant":
            raise RendererError(
                "messages: a conversation needs a prompt, then assistant turns, the last one an "
                "assistant turn"
            )
        first = roles.index("assistant")
        history = [dict(m) for m in messages[:first]]
        tokens = self.initial_prompt(history, tools)
        weights = [0.0] * len(tokens)
        index = first
        while index < len(messages):
            reply = dict(messages[index])
            turn = self.assistant_turn(history, reply, tools)
            tokens += turn
            weights += [1.0] * len(turn)
            history.append(reply)
            index += 1
            observation = []
            while index < len(messages) and roles[index] != "assistant":
                message = dict(messages[index])
                if message.get("role") == "tool" and isinstance(message.get("content"), str):
                    message["content"] = self.neutralize(message["content"])
                observation.append(message)
                index += 1
            if index < len(messages) and not observation:
                raise RendererError(
                    f"messages[{index}]: two assistant turns in a row; an observation (tool "
                    "results or a user message) comes between them"
                )
            if observation:
                delta = self.observation_delta(observation, after_stop_token=True)
                tokens += delta
                weights += [0.0] * len(delta)
                history += observation
        return tokens, weights

    def neutralize(self, text: str) -> str:
        """`text` with each control-token string (`<|im_end|>`, ...) broken by a zero-width space
        after its first character, so untrusted text (tool results) can never be tokenised into
        chat structure (a fake end of turn, a fake assistant turn)."""
        for token in self.control_strings:
            if token in text:
                text = text.replace(token, token[0] + ZERO_WIDTH_SPACE + token[1:])
        return text

    # -- replies --------------------------------------------------------------------------------

    def ends_with_stop(self, tokens: Sequence[int]) -> bool:
        """Whether a sampled reply ended with one of the stop tokens."""
        return bool(tokens) and tokens[-1] in self._stop_id_set

    def parse_reply(self, tokens: Sequence[int]) -> ParsedReply:
        """Content, reasoning and tool calls of a sampled reply (its stop token ignored)."""
        body = tokens[:-1] if self.ends_with_stop(tokens) else tokens
        return parse_hermes(self.decode(body))

    # -- setup ----------------------------------------------------------------------------------

    def _resolve_stop_strings(
        self, template: str, stop_tokens: Sequence[str] | None
    ) -> tuple[str, ...]:
        if stop_tokens is not None:
            if not stop_tokens:
                raise RendererError("stop_tokens: give at least one stop token")
            return tuple(stop_tokens)
        found: list[str] = []
        eos = getattr(self.tokenizer, "eos_token", None)
        if isinstance(eos, str) and eos:
            found.append(eos)
        for candidate in KNOWN_END_OF_TURN:
            if candidate in template and candidate not in found and self._is_token(candidate):
                found.append(candidate)
        if not found:
            raise RendererError(
                "tokenizer.eos_token: the tokenizer names no eos token and the template uses no "
                f"known end-of-turn token {KNOWN_END_OF_TURN}; pass stop_tokens="
            )
        return tuple(found)

    def _is_token(self, text: str) -> bool:
        token_id = self.tokenizer.convert_tokens_to_ids(text)
        return token_id is not None and token_id != getattr(self.tokenizer, "unk_token_id", None)

    def _single_token_id(self, text: str) -> int:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise RendererError(
                f"stop_tokens: {text!r} must be a single token of this tokenizer, got ids {ids}"
            )
        return int(ids[0])


@functools.lru_cache(maxsize=8)
def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
