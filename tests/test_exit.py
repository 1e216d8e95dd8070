"""A process with a sharded model ends cleanly, its model collected like any object, also
when its c10d store answers late at exit.

A daemon thread that comes back from a torch call after the interpreter's teardown began
aborts the process ("terminate called without an active exception"). The script's store
host is stopped while the process exits (its watchdog's responder is inside a store call),
and continued while the interpreter tears down, which takes ``exit_script.TEARDOWN_S``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).with_name("exit_script.py")
SERVE = """
import sys, time
from datetime import timedelta
from pathlib import Path
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=60), wait_for_workers=False)
Path(sys.argv[1] + ".tmp").write_text(str(store.port))
Path(sys.argv[1] + ".tmp").rename(sys.argv[1])
time.sleep(120)
"""
STALL_S = 4.0  # past the script's second of waiting and 2 s of exit, into its teardown


def _wait_for(path: Path, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 120
    while not path.exists():
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, f"no {path.name}:\n{log.read_text()[-4000:]}"
        time.sleep(0.05)


def test_a_late_store_answer_at_exit_ends_the_process_cleanly(tmp_path: Path) -> None:
    log = tmp_path / "script.out"
    port_file = tmp_path / "port"
    with (tmp_path / "server.out").open("w") as out:
        serve = [sys.executable, "-c", SERVE, str(port_file)]
        server = subprocess.Popen(serve, stdout=out, stderr=out)
    try:
        _wait_for(port_file, server, tmp_path / "server.out")
        port = port_file.read_text()
        with log.open("w") as out:
            command = [sys.executable, str(SCRIPT), port, str(tmp_path)]
            script = subprocess.Popen(command, stdout=out, stderr=out)
        _wait_for(tmp_path / "ready", script, log)
        os.kill(server.pid, signal.SIGSTOP)
        (tmp_path / "stopped").write_text("yes")
        time.sleep(STALL_S)
        os.kill(server.pid, signal.SIGCONT)
        status = script.wait(timeout=60)
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        server.wait()
    output = log.read_text()
    assert status == 0, f"exit status {status}:\n{output[-4000:]}"
    assert "terminate called" not in output, output[-4000:]
    assert (tmp_path / "model-collected").exists(), "the model was kept past the teardown"
