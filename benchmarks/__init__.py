"""The benchmarks and diagnostics: scripts run from the checkout (``make bench``, ``make gpu-bench``),
sharing ``measure``; the GPU benchmark's modules are the package ``gpu``."""
