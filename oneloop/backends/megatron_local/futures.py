"""Futures of the local backend: the SDK's own `AwaitableConcurrentFuture` over a Ray ObjectRef.

Awaitable, `.result(timeout)`, `.future()`, exactly like the SDK's. Ray wraps an actor's exception
in `RayTaskError`; we re-raise the original (a `RequestError` stays a `RequestError`).
"""

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import ray
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

from oneloop.errors import BackendError


def _unwrap(error: BaseException) -> BaseException:
    if isinstance(error, ray.exceptions.RayTaskError):
        cause = error.cause
        if isinstance(cause, BaseException):
            return cause
    if isinstance(error, ray.exceptions.RayActorError):
        return BackendError(f"a backend actor died: {error}")
    return error


def chain[T](
    source: "ray.ObjectRef | Future[Any]", convert: Callable[[Any], T]
) -> AwaitableConcurrentFuture[T]:
    """A future of `convert(result of source)`; `source` is an ObjectRef or a concurrent Future."""
    upstream: Future[Any] = source.future() if isinstance(source, ray.ObjectRef) else source
    out: Future[T] = Future()

    def done(finished: Future[Any]) -> None:
        try:
            out.set_result(convert(finished.result()))
        except BaseException as error:  # noqa: BLE001 - delivered to whoever awaits the future
            out.set_exception(_unwrap(error))

    upstream.add_done_callback(done)
    return AwaitableConcurrentFuture(out)


def completed[T](value: T) -> AwaitableConcurrentFuture[T]:
    """An already-finished future (for calls that need no remote work)."""
    out: Future[T] = Future()
    out.set_result(value)
    return AwaitableConcurrentFuture(out)
