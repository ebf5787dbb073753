"""`oneloop serve`: the local backend behind the Tinker HTTP protocol, for the unmodified SDK.

Modules: `server` (config, entry points), `app` (routes), `service` (the verbs), `state`
(sessions, models, samplers, checkpoints), `futures` (request store, long poll, seq_id order),
`wire` (JSON request models), `proto` (protobuf codec), `security` (bind policy, key, limits).
"""

from .server import ServeConfig, ServerThread, run_server, serve_main

__all__ = ["ServeConfig", "ServerThread", "run_server", "serve_main"]
