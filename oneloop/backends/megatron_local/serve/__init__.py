"""`oneloop serve`: the local backend behind the Tinker HTTP protocol, for the unmodified SDK.

Modules: `server` (config, entry points), `app` (routes) and `hot_routes` (the two sampling
requests, in front of FastAPI), `service` (the verbs), `state` (sessions, models, samplers,
checkpoints), `request_store` (futures: request store, long poll, seq_id order), `wire` (JSON
request models), `codec/` (protobuf codec: the fast and the reference decoder, the result
encoders; its `__init__` maps which is which), `security` (bind policy, key, limits).
"""

from oneloop.backends.megatron_local.serve.server import (
    ServeConfig,
    ServerThread,
    run_server,
    serve_main,
)

__all__ = ["ServeConfig", "ServerThread", "run_server", "serve_main"]
