"""A pdserve command stopped with SIGTERM (a service manager, `timeout`, a CI runner) stops what
it started: `pdserve bench` and `pdserve plan calibrate` run servers in process groups of their
own, which a signal to the command alone would leave behind."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil

from tests.conftest import REPO

COMMAND = """
import subprocess, time
from pdserve.bench.compare import _stop
from pdserve.cli import exit_on_sigterm

exit_on_sigterm()
child = subprocess.Popen(["sleep", "600"], process_group=0)  # as the bench starts a server
try:
    print(child.pid, flush=True)
    time.sleep(600)
finally:
    _stop(child)
"""


def test_sigterm_unwinds_a_command_and_stops_the_server_it_started():
    command = subprocess.Popen(
        [sys.executable, "-c", COMMAND], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    server = int(command.stdout.readline())
    assert psutil.pid_exists(server)
    command.send_signal(signal.SIGTERM)
    assert command.wait(timeout=60) == 128 + signal.SIGTERM
    assert not psutil.pid_exists(server)
