"""``ucm-ray serve FILE`` as a user runs it, for the Serve e2e tests: started against a private
cluster like a script's background job, waited on through the OpenAI API, stopped with the
signal Ctrl-C sends; and Prometheus reads of Ray's metrics export."""

from __future__ import annotations

import glob
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from openai import OpenAI

from tests.support import ROOT
from tests.support.private_cluster import PrivateCluster, cluster_env


def start_serve(config_file: Path, cluster: PrivateCluster, log: Path) -> subprocess.Popen:
    """Started the way a script starts a background job (``ucm-ray serve ... &``): SIGINT ignored."""
    return subprocess.Popen([sys.executable, "-m", "ucm_ray.cli", "serve", str(config_file),
                             "--address", cluster.address], cwd=ROOT, env=cluster_env(), stdin=subprocess.DEVNULL,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))


def stop_serve(serve: subprocess.Popen, timeout_s: float = 60) -> tuple[bool, float]:
    """What Ctrl-C (or ``kill -INT``) sends; (whether it had to be killed, seconds it took)."""
    stopping = time.monotonic()
    serve.send_signal(signal.SIGINT)
    try:
        serve.wait(timeout=timeout_s)
        killed = False
    except subprocess.TimeoutExpired:
        serve.kill()
        serve.wait()
        killed = True
    return killed, time.monotonic() - stopping


def pools_left(ray_namespace: str, timeout_s: float = 15) -> list[str]:
    """The app's pool files still in /dev/shm once they had ``timeout_s`` to go."""
    deadline = time.monotonic() + timeout_s
    while glob.glob(f"/dev/shm/ucmray-{ray_namespace}-*") and time.monotonic() < deadline:
        time.sleep(0.5)
    return glob.glob(f"/dev/shm/ucmray-{ray_namespace}-*")


def wait_ready(base_url: str, models: set[str], serve: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert serve.poll() is None, f"ucm-ray serve exited {serve.returncode}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"app not up after {timeout_s} s:\n{log.read_text()[-4000:]}"
        try:
            listed = OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=5).models.list()
            if models <= {m.id for m in listed.data}:
                return
        except Exception:  # noqa: BLE001 -- not up yet: connection refused, 404, 503
            pass
        time.sleep(2)


def scrape(port: int, metric: str, model: str) -> float | None:
    """Sum of ``metric``'s series for ``model`` on Ray's metrics export port; None where ``model``
    has no such series (absent is not zero: a name or label that changed reads as absent too)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if re.match(rf"{metric}(_total)?{{", line) and f'model_name="{model}"' in line]
    return sum(values) if values else None


def wait_metric(port: int, metric: str, model: str, expected: float, timeout_s: float = 30.0) -> float | None:
    deadline = time.monotonic() + timeout_s
    value = scrape(port, metric, model)
    while value != expected and time.monotonic() < deadline:
        time.sleep(1)
        value = scrape(port, metric, model)
    return value
