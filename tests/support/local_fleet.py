"""``ucm-ray up --local`` run as a subprocess: its own Ray cluster, temp dir and log files."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

RUNNING = "local fleet running"


def _as_a_background_job() -> None:
    """In the child before it runs the CLI: SIGINT and SIGQUIT ignored, as a non-interactive
    shell starts a background job (``ucm-ray up --local &`` in a script): Python then installs no
    KeyboardInterrupt handler of its own, so only the CLI's handlers make SIGINT stop it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)


class LocalFleet:
    """One ``ucm-ray up --local`` process; ``close`` ends whatever of it is still running."""

    def __init__(self, workdir: Path, *flags: str) -> None:
        self.ray_tmp = tempfile.mkdtemp(prefix="ucmr-", dir="/tmp")
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
               "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": self.ray_tmp}
        env.pop("RAY_ADDRESS", None)  # never join the test session's cluster
        self.stdout = workdir / "up.out"
        self.stderr = workdir / "up.err"
        with open(self.stdout, "w") as out, open(self.stderr, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "ucm_ray.cli", "up", "--local", *flags],
                                         stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True, preexec_fn=_as_a_background_job)
        self._family: list[psutil.Process] = []

    def log(self) -> str:
        return self.stderr.read_text()[-4000:]

    def wait_running(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while RUNNING not in self.stderr.read_text():
            assert self.proc.poll() is None, f"ucm-ray up --local exited {self.proc.returncode}:\n{self.log()}"
            assert time.monotonic() < deadline, f"ucm-ray up --local not running after {timeout_s} s:\n{self.log()}"
            time.sleep(0.5)
        # Remember its Ray processes now, to make sure none outlives it.
        self._family = psutil.Process(self.proc.pid).children(recursive=True)

    def pools(self, shm_dir: str, ray_namespace: str) -> list[str]:
        return sorted(glob.glob(os.path.join(shm_dir, f"ucmray-{ray_namespace}-*")))

    def stop(self, sig: signal.Signals, timeout_s: float = 120.0) -> int:
        """Send ``sig`` to the CLI process (only it, as Kubernetes or systemd would) and wait."""
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"ucm-ray up --local still running {timeout_s} s after {sig.name}:\n"
                                 f"{self.log()}") from None

    def leftover_processes(self, timeout_s: float = 30.0) -> list[psutil.Process]:
        _, alive = psutil.wait_procs(self._family, timeout=timeout_s)
        return alive

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        for p in self._family:  # the processes this test started, by pid
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(self.ray_tmp, ignore_errors=True)
