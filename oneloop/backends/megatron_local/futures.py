"""Futures of the local backend: the SDK's own `AwaitableConcurrentFuture` over a Ray ObjectRef.

Awaitable, `.result(timeout)`, `.future()`, exactly like the SDK's. Ray wraps an actor's exception
in `RayTaskError`; we re-raise the original (a `RequestError` stays a `RequestError`).
"""

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

import ray
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

from oneloop.errors import BackendError


def _settle(out: Future, value: Any = None, error: BaseException | None = None) -> None:
    """Deliver a result, unless the consumer already cancelled `out` (a timed-out wait)."""
    if out.done():
        return
    try:
        if error is None:
            out.set_result(value)
        else:
            out.set_exception(error)
    except InvalidStateError:  # cancelled between the check and the set
        pass


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
            _settle(out, convert(finished.result()))
        except BaseException as error:  # noqa: BLE001 - delivered to whoever awaits the future
            _settle(out, error=_unwrap(error))

    upstream.add_done_callback(done)
    return AwaitableConcurrentFuture(out)


def completed[T](value: T) -> AwaitableConcurrentFuture[T]:
    """An already-finished future (for calls that need no remote work)."""
    out: Future[T] = Future()
    out.set_result(value)
    return AwaitableConcurrentFuture(out)


def chain_with_recovery[T](
    submit: Callable[[], "ray.ObjectRef"],
    convert: Callable[[Any], T],
    recover: Callable[[], "ray.ObjectRef"],
    should_recover: Callable[[BaseException], bool],
    attempts: int = 3,
) -> AwaitableConcurrentFuture[T]:
    """Like `chain(submit(), convert)`, but an error `should_recover` accepts runs `recover()`
    (e.g. re-install weights on a restarted actor) and resubmits, up to `attempts` times."""
    out: Future[T] = Future()

    def start(left: int) -> None:
        upstream = submit().future()
        upstream.add_done_callback(lambda f: done(f, left))

    def done(finished: Future[Any], left: int) -> None:
        if out.cancelled():
            return  # the consumer gave up waiting: no retries on its behalf
        try:
            _settle(out, convert(finished.result()))
        except BaseException as error:  # noqa: BLE001 - delivered to whoever awaits the future
            cause = _unwrap(error)
            if left > 1 and (should_recover(cause) or should_recover(error)):
                # Recover off Ray's callback thread: a blocking get there could deadlock.
                threading.Thread(target=retry, args=(left,), daemon=True).start()
            else:
                _settle(out, error=cause)

    def retry(left: int) -> None:
        try:
            ray.get(recover(), timeout=RECOVER_TIMEOUT_S)
        except BaseException:  # noqa: BLE001 - the actor may still be restarting: try again
            time.sleep(1.0)
        start(left - 1)

    start(attempts)
    return AwaitableConcurrentFuture(out)


def gather(futures: list[AwaitableConcurrentFuture[Any]]) -> Future[list[Any]]:
    """One future of every result of `futures`, in order; the first error fails it."""
    out: Future[list[Any]] = Future()
    results: list[Any] = [None] * len(futures)
    left = [len(futures)]
    lock = threading.Lock()

    def done(index: int, finished: Future[Any]) -> None:
        try:
            value = finished.result()
        except BaseException as error:  # noqa: BLE001 - delivered to whoever awaits the future
            with lock:
                _settle(out, error=error)
            return
        with lock:
            results[index] = value
            left[0] -= 1
            if left[0] == 0:
                _settle(out, results)

    if not futures:
        out.set_result([])
    for index, future in enumerate(futures):
        future.future().add_done_callback(lambda f, i=index: done(i, f))
    return out


# How long re-installing weights on a restarted actor may take.
RECOVER_TIMEOUT_S = 300.0
