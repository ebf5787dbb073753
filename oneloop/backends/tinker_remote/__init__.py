"""Backend `tinker`: the official `tinker` SDK's own clients, pointed at a Tinker service.

Thinking Machines' service, any compatible server, or our own `oneloop serve` — only the URL
differs. The SDK already retries requests (connection errors, 5xx, 429) with backoff; what it does
not retry here (the one-shot capability discovery) is retried with tenacity. Capabilities are the
documented table (`capabilities.TINKER_SERVICE`) narrowed by the server's model list.
"""

from dataclasses import replace
from typing import Any

import tinker
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from oneloop.backends.capabilities import TINKER_SERVICE, Capabilities
from oneloop.backends.config import BackendConfig
from oneloop.errors import BackendError

# Errors worth retrying during discovery: the server is starting or briefly unreachable.
_TRANSIENT = (tinker.APIConnectionError, tinker.APITimeoutError, tinker.InternalServerError)


def connect_remote(config: BackendConfig) -> tinker.ServiceClient:
    """The SDK's ServiceClient for `config.tinker` (base URL and key; SDK env vars otherwise)."""
    remote = config.tinker
    return tinker.ServiceClient(base_url=remote.base_url, api_key=remote.api_key)


def remote_capabilities(config: BackendConfig) -> Capabilities:
    """The service's capabilities: our table for it, narrowed by `get_server_capabilities`."""
    remote = config.tinker

    @retry(
        retry=retry_if_exception_type(_TRANSIENT),
        stop=stop_after_attempt(remote.max_retries + 1),
        wait=wait_exponential_jitter(initial=0.5, max=10.0),
        reraise=True,
    )
    def discover() -> Any:
        rest = tinker.RestClient(base_url=remote.base_url, api_key=remote.api_key)
        return rest.get_server_capabilities().result(timeout=remote.timeout_s)

    try:
        answer = discover()
    except _TRANSIENT as error:
        raise BackendError(
            f"tinker service at {remote.base_url or '(SDK default)'} did not answer "
            f"get_server_capabilities after {remote.max_retries + 1} attempts: {error}"
        ) from error
    models = frozenset(m.model_name for m in answer.supported_models if m.model_name)
    return replace(TINKER_SERVICE, models=models)
