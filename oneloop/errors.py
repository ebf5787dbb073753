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


class LossInputError(RequestError):
    """A loss name, `loss_fn_config` or `loss_fn_inputs` that the losses cannot use as given."""


class MissingWeightsError(BackendError):
    """The sampler lacks the weights a client needs (it restarted, or they were replaced by older
    ones after a restart); the client re-installs its own and retries."""


class MissingDependencyError(OneloopError, RuntimeError):
    """A configured engine needs an optional dependency that is not installed here; the message
    names the setting and the extra to install (`oneloop[gpu]` on a CUDA host)."""


class WireError(OneloopError):
    """A request `oneloop serve` refuses; `status` is the HTTP status, the message names the field.
    `retry` overrides the SDK's retry decision for this response where set."""

    def __init__(self, message: str, status: int = 400, *, retry: bool | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry = retry
