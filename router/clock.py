"""The router's clock: the running event loop's time (time.monotonic in a served router).

Every time the router reads — deadlines, silences, rate windows, hand-over gaps, cool-downs —
comes from here, so the simulator (pdserve/sim) runs the same code in virtual time.
"""

from __future__ import annotations

import asyncio
import time


def now() -> float:
    """Seconds on the event loop's clock; `time.monotonic()` outside a running loop (the same
    clock in a served router: asyncio's loops read it)."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()
