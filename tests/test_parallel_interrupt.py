"""A run of forked workers ended early (Ctrl-C, an error raised by the ``done`` callback) at random instants,
while the workers send results larger than a pipe's buffer: it ends at once and leaves no worker behind.

``multiprocessing.Pool.terminate()`` could wait forever there (a worker SIGTERMed while it held the result
queue's lock, a result half-written into the queue, a worker blocked on the full queue after the result handler
had left), about 1 in 30 such interrupts; a Ctrl-C during the pool's start left its workers running. Each of
those fails the scenario below (a timeout or a leftover child) with high probability within its few seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO

SCENARIO = """
import os, random, signal, sys, threading, time
from ckptdoctor.parallel import map_units

payload = b"x" * 150_000  # over a pipe's 64 KiB: a worker is most often inside a send when the run ends
armed = False


def on_sigint(signum, frame):
    if armed:
        raise KeyboardInterrupt


def ctrl_c() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # the main thread takes it, as a terminal's would
    os.kill(os.getpid(), signal.SIGINT)


def no_child_left() -> None:
    try:
        os.waitpid(-1, os.WNOHANG)  # returns while this process has a child, running or not yet reaped
    except ChildProcessError:
        return
    raise SystemExit("a worker was left behind")


signal.signal(signal.SIGINT, on_sigint)
rng = random.Random(int(sys.argv[1]))
deadline = time.monotonic() + float(sys.argv[2])
trials = 0
while time.monotonic() < deadline:
    stop = rng.randrange(24)
    if trials % 2:  # Ctrl-C at a random instant, pool start and end included
        timer = threading.Timer(rng.uniform(0, 0.02), ctrl_c)
        done = None
    else:  # an error from the done callback, at a random unit

        def done(index):
            if index >= stop:
                raise KeyboardInterrupt

    try:
        armed = True
        if done is None:
            timer.start()
        map_units([1] * 64, lambda index: payload, jobs=4, done=done)
        armed = False
    except KeyboardInterrupt:
        armed = False
    if done is None:
        timer.join()
    no_child_left()
    trials += 1
print(trials)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forked workers")
def test_ending_a_run_early_never_blocks_and_leaves_no_worker():
    seconds = 3.0
    proc = subprocess.Popen(
        [sys.executable, "-c", SCENARIO, str(time.time_ns() % 1000), str(seconds)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=seconds + 5)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("ending a run of workers early blocked (more than 5 s past the scenario's end)")
    assert proc.returncode == 0, err
    assert int(out) > 20, out  # enough interrupted runs to mean something
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # no worker outlived the scenario
