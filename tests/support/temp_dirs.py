"""Temp dirs of the Ray sessions tests start (``/tmp/ucmr-*``): removed once their tests passed,
kept when one failed while the dir was in use.

Each holds a cluster's Ray logs (about 13 MB); stop 66's runs left 128 of them. A failed test's
dir is kept and named in a warning: its raylet and worker logs were the only trace of the
multinode lookup flake (stop 66).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass

import pytest

log = logging.getLogger(__name__)

_failed_reports = 0
"""Failed test reports (setup, call or teardown) seen in this process so far."""


def count_report(report: pytest.TestReport) -> None:
    """``tests/conftest.py``'s ``pytest_runtest_logreport``: count the failures."""
    global _failed_reports
    if report.failed:
        _failed_reports += 1


@dataclass
class RayTempDir:
    """A temp dir and how many failures had been reported when it was made."""

    path: str
    failures_before: int

    def release(self, failed: bool = False) -> None:
        """Remove the dir, unless ``failed`` or a test failed since it was made."""
        if failed or _failed_reports > self.failures_before:
            log.warning("kept the Ray logs of a failed test in %s", self.path)
            return
        shutil.rmtree(self.path, ignore_errors=True)


def make_temp_dir(prefix: str = "ucmr-") -> RayTempDir:
    return RayTempDir(tempfile.mkdtemp(prefix=prefix, dir="/tmp"), _failed_reports)
