"""The GPU benchmark's command line (``make gpu-bench``, ``make gpu-bench-decode``); its parts are
the package ``benchmarks/gpu/`` (see there)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: benchmarks.*
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from benchmarks.gpu.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
