"""A pytest plugin: each test's start and each setup / call / teardown as it ends, with the Unix
time, one line each, to $TS_OUT (default /tmp/ts.log). `-p tsplugin` with this folder on
PYTHONPATH."""

import os
import time

_out = open(os.environ.get("TS_OUT", "/tmp/ts.log"), "a", buffering=1)


def pytest_runtest_logstart(nodeid, location):
    _out.write(f"{time.time():.1f} start {nodeid}\n")


def pytest_runtest_logreport(report):
    _out.write(
        f"{time.time():.1f} {report.when} {report.outcome} {report.duration:.1f} {report.nodeid}\n"
    )
