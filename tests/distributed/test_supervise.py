"""pretrain-launch's Ctrl-C (pretrain/distributed/supervise.py ``run_launcher``, ``CtrlC``), in this process with a
stand-in launcher and worker (two small Python processes): the SIGINTs of one Ctrl-C are one, however many times
a wrapper delivers them; a later Ctrl-C still stops at once. (A real launch under a real wrapper:
tests/train/test_run.py's Ctrl-C fixture.)"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import psutil

from pretrain.distributed.supervise import CTRL_C_WINDOW_S, CtrlC, run_launcher


def test_sigints_within_the_window_of_a_ctrl_c_are_that_ctrl_c():
    now = [0.0]
    ctrl_c = CtrlC(clock=lambda: now[0])
    assert ctrl_c.press() and ctrl_c.presses == 1
    for now[0] in (0.001, 0.5, CTRL_C_WINDOW_S - 0.01):  # measured from the press's first SIGINT, not the last
        assert not ctrl_c.press()
    now[0] = CTRL_C_WINDOW_S
    assert ctrl_c.press() and ctrl_c.presses == 2
    assert CTRL_C_WINDOW_S == 1.0


# accelerate launch's stand-in: one worker, its exit code passed on
LAUNCHER = "import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', sys.argv[1], sys.argv[2]]))"
# the worker: says it is ready (its pid), then one line per SIGINT it receives
WORKER = """
import os, signal, sys, time
log = sys.argv[1]
signal.signal(signal.SIGINT, lambda *_: open(log, "a").write("SIGINT\\n"))
with open(log + ".tmp", "w") as f:
    f.write(f"{os.getpid()}\\n")
os.replace(log + ".tmp", log)
time.sleep(120)
"""


def test_a_ctrl_c_delivered_twice_reaches_the_workers_once_and_a_later_one_stops_at_once(tmp_path, capsys):
    """The terminal's SIGINT and a wrapper's copy of it, a millisecond apart: pretrain-launch sends one SIGINT to the
    worker and keeps the launch (before, the copy was "Ctrl-C again": the launch SIGKILLed, the steps since the last
    checkpoint lost). A Ctrl-C after the window stops every process at once, as before."""
    log = tmp_path / "worker.log"
    main = threading.main_thread().ident
    seen = {}

    def ctrl_c() -> None:  # SIGINT to the main thread (in run_launcher's wait), as a terminal and a wrapper send it
        deadline = time.monotonic() + 60
        while not log.is_file() and time.monotonic() < deadline:
            time.sleep(0.02)
        worker = int(log.read_text().split()[0])
        signal.pthread_kill(main, signal.SIGINT)  # the terminal's
        time.sleep(0.001)
        signal.pthread_kill(main, signal.SIGINT)  # the wrapper's copy
        first = time.monotonic()
        while log.read_text().count("SIGINT") < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(max(0.0, first + CTRL_C_WINDOW_S + 0.2 - time.monotonic()))
        seen["worker alive"] = psutil.pid_exists(worker) and psutil.Process(worker).status() != psutil.STATUS_ZOMBIE
        seen["SIGINTs"] = log.read_text().count("SIGINT")
        signal.pthread_kill(main, signal.SIGINT)  # Ctrl-C again, a second later

    threading.Thread(target=ctrl_c, daemon=True).start()
    code = run_launcher([sys.executable, "-c", LAUNCHER, WORKER, str(log)], dict(os.environ))
    err = capsys.readouterr().err
    assert seen == {"worker alive": True, "SIGINTs": 1}, (seen, err)
    assert code == 130 and "interrupted: Ctrl-C again: stopped every process at once" in err, err
