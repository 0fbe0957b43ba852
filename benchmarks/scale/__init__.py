"""The scale-out simulation's parts (``benchmarks/scale_sim.py`` is the entry): a seeded workload,
a cluster of the real ``BlockIndex`` pools placed by the real ``owners``, the designs, metrics."""
