from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# engines look up a step-time calibration at start: none from this machine's cache in tests
os.environ["PDSERVE_CALIBRATION_DIR"] = tempfile.mkdtemp(prefix="pdserve-test-calibration-")
atexit.register(shutil.rmtree, os.environ["PDSERVE_CALIBRATION_DIR"], True)

REPO = Path(__file__).resolve().parent.parent
TIERS = ("logic", "sockets", "engines", "e2e")
"""Test tiers by cost, one folder each: pure logic with fakes; real sockets and tools on
loopback; real vLLM engines in Ray actors; a real `pdserve serve`. `make test-fast` runs the
first two."""


def pytest_collection_modifyitems(config, items):
    """Mark every test with its tier (the folder it lives in)."""
    for item in items:
        tier = Path(item.fspath).relative_to(REPO / "tests").parts[0]
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded default model, prepared once (bootstrap already built it; this only checks)."""
    from pdserve_core.model_prep import prepare_default_model

    return prepare_default_model()


_MODULE_SECONDS: dict[str, float] = {}
_PHASE_SECONDS: dict[str, float] = {}


@contextlib.contextmanager
def phase(name: str):
    """Time a part of a long fixture (a server's start, one batch of cases): the summary lists
    each phase of 5 s or more under its module's time, so a closing note can say where a
    fixture's minutes went."""
    started = time.monotonic()
    try:
        yield
    finally:
        _PHASE_SECONDS[name] = _PHASE_SECONDS.get(name, 0.0) + time.monotonic() - started


def pytest_runtest_logreport(report):
    """Each test's setup, call and teardown, added to its module's time (module-scoped fixtures
    count where they run: with the module's first or last test)."""
    module = report.nodeid.split("::", 1)[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """Where the suite's minutes went, per module (the closing notes quote it)."""
    if not _MODULE_SECONDS:
        return
    total = sum(_MODULE_SECONDS.values())
    terminalreporter.section(f"time per module ({total / 60:.1f} min in tests)")
    for module, seconds in sorted(_MODULE_SECONDS.items(), key=lambda item: -item[1]):
        if seconds >= 1.0:
            terminalreporter.write_line(f"{seconds / 60:6.2f} min  {module}")
    phases = [(name, seconds) for name, seconds in _PHASE_SECONDS.items() if seconds >= 5.0]
    if phases:
        terminalreporter.section("time per phase (inside fixtures)")
        for name, seconds in phases:
            terminalreporter.write_line(f"{seconds:7.1f} s  {name}")
