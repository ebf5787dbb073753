"""The oneloop exception hierarchy. Every error says what was wrong and how to fix it."""


class OneloopError(Exception):
    """Base class of every error oneloop raises on purpose."""


class ConfigError(OneloopError, ValueError):
    """A configuration value is missing, malformed or unsupported; the message names its path."""


class CapabilityError(ConfigError):
    """A requested knob is not supported by the selected backend; raised before a run starts."""


class RequestError(OneloopError, ValueError):
    """A client request (datum, sampling params, path) is malformed; the message names the field."""


class CheckpointNotFoundError(RequestError):
    """A `tinker://` path does not name a saved checkpoint."""


class BackendError(OneloopError, RuntimeError):
    """A backend component (actor, engine, server) failed while serving a valid request."""
