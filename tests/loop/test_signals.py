"""SIGTERM and SIGINT stop a command cleanly (`oneloop.loop.signals`), in process with real
signals: the command's cleanup runs, the status is 128 + the signal number, a checkpoint section
is never cut, and the handlers survive a library (Ray's `ray.init`) replacing them. The whole
`oneloop train` under SIGTERM is tested in test_resume."""

import asyncio
import os
import signal
import sys

import pytest

from oneloop.loop.signals import (
    STOP_SIGNALS,
    Stopped,
    deferred_stop,
    reclaim_signals,
    run_stoppable,
    stop_requested,
)


@pytest.fixture(autouse=True)
def pytest_handlers():
    """A stop leaves both signals at their default action (a second one ends the process at
    once); give pytest its own handlers back."""
    saved = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


async def until_stop_requested() -> None:
    """A few loop turns: the signal's handler runs on the loop after the C-level handler."""
    while stop_requested() is None:
        await asyncio.sleep(0)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_command_after_its_cleanup(signum):
    events = []

    async def command():
        try:
            os.kill(os.getpid(), signum)
            await asyncio.Event().wait()  # never set: only the stop ends it
            events.append("ran on")
        finally:
            await asyncio.sleep(0)  # cleanup may await (closing clients)
            events.append("cleaned up")

    with pytest.raises(Stopped) as stopped:
        run_stoppable(command(), "test")
    assert stopped.value.signum == signum
    assert stopped.value.exit_status == 128 + signum  # 143 for SIGTERM, 130 for SIGINT
    assert events == ["cleaned up"]
    assert signal.getsignal(signum) is signal.SIG_DFL  # a second signal now ends at once


def test_a_command_without_a_signal_returns_its_result():
    async def command():
        return 7

    assert run_stoppable(command(), "test") == 7
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_signal_inside_a_checkpoint_section_waits_for_its_end():
    """The section (save_state, then the checkpoints.jsonl line) completes; the stop takes
    effect at the first await after it."""
    events = []

    async def command():
        with deferred_stop():
            os.kill(os.getpid(), signal.SIGTERM)
            await until_stop_requested()
            await asyncio.sleep(0)
            events.append("checkpoint written")
        events.append("after the section")  # no await in between: still runs
        await asyncio.sleep(0)
        events.append("next step")

    with pytest.raises(Stopped):
        run_stoppable(command(), "test")
    assert events == ["checkpoint written", "after the section"]


def test_reclaim_puts_the_handlers_back_after_a_library_replaced_them():
    """Regression (issue 21): `ray.init` installs a SIGTERM handler that calls sys.exit from
    whatever code runs; `oneloop train` died of it with status 134 and a C++ stack trace."""

    async def command():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # as Ray does
        reclaim_signals()
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.Event().wait()

    with pytest.raises(Stopped):
        run_stoppable(command(), "test")
