"""An OpenAI-compatible TITO gateway: `/v1/chat/completions` and `/v1/completions` in front of a
Tinker `SamplingClient`, keeping each session's exact token trajectory for training.

Modules: `wire` (request models, OpenAI-shaped errors), `render` (messages ↔ our renderer and
tool-call parser), `sessions` (TITO accounting, segments, limits), `routes` (the HTTP app),
`server` (in-process thread and the `oneloop gateway` CLI), `litellm_agent` (a minimal Harbor
agent that reaches its model through LiteLLM).
"""

from typing import Any

__all__ = ["Gateway", "GatewayConfig", "SamplingDefaults", "Session", "SessionStore", "main"]
_HOMES = {
    "Gateway": "server", "GatewayConfig": "server", "main": "server",
    "SamplingDefaults": "sessions", "Session": "sessions", "SessionStore": "sessions",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    # Lazy: the loop imports `gateway.trial` for agent defaults without loading the HTTP stack.
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
