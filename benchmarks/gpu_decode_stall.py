"""Diagnostic (GPU): what slows an engine's first decode steps after a long prompt's save
(``benchmarks/gpu/stall.py``: its flags, and what each variant switches)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: benchmarks.*
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from benchmarks.gpu.stall import main  # noqa: E402

if __name__ == "__main__":
    main()
