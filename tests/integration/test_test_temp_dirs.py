"""The tests' own Ray temp dirs: gone after a cluster whose use passed, kept and named after one
that failed (stop 66's runs left 128 of them in /tmp, ~13 MB of Ray logs each)."""

from __future__ import annotations

import os
import re
import shutil

import pytest

from tests.support.private_cluster import PrivateCluster, run_driver


def test_a_private_clusters_ray_logs_go_when_its_use_passed_and_stay_named_when_it_failed():
    cluster = PrivateCluster([{"num_cpus": 1}])
    passed_dir = cluster.temp_dir
    assert os.listdir(passed_dir), "the cluster wrote no logs: nothing to check"
    cluster.close()
    assert not os.path.exists(passed_dir), "a passed cluster's Ray logs were left in /tmp"

    with pytest.raises(AssertionError, match="Ray logs kept in") as failure:
        run_driver("no_such_driver.py", [], [{"num_cpus": 1}], timeout_s=60)
    named = re.search(r"Ray logs kept in (\S+)\)", str(failure.value))
    assert named, str(failure.value)[-500:]
    kept = named.group(1)
    try:
        assert os.path.isdir(kept) and os.listdir(kept), f"the failed run's logs are not in {kept}"
    finally:
        shutil.rmtree(kept, ignore_errors=True)
