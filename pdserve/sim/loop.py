"""Virtual time for the simulator: an asyncio event loop whose clock jumps to its next timer.

The router's code runs unchanged on it: `asyncio.sleep`, `asyncio.timeout` and every other timer
read `loop.time()`, and so does the router's clock (router/clock.py). When nothing is ready to
run, the loop does not wait for its next timer: it moves its clock there. A run of hours of
traffic takes as long as the callbacks take to run, and the same run gives the same result.

Nothing may wait on the world outside (a socket, a thread): with no timer left and nothing
ready, the simulation is stuck, and says so instead of hanging.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class SimulationStuck(RuntimeError):
    """Every task waits and no timer is set: nothing will ever run again."""


class _JumpingSelector(selectors.DefaultSelector):
    """Polls (the loop's own wake-up pipe still works) and, where the loop would block until its
    next timer, moves the clock there instead."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise SimulationStuck("every task waits and no timer is set")
        self._loop.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self.now


def run(main: Coroutine[Any, Any, T], start: float = 0.0) -> T:
    """Run `main` to its end in virtual time from `start` seconds (a fresh loop; closed after)."""
    loop = VirtualTimeLoop(start)
    try:
        return loop.run_until_complete(main)
    finally:
        loop.close()
