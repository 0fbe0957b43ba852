"""GPU data-plane benchmark: the connector worker's real copy path into vLLM-shaped paged KV.

Modules, one part each: ``data_plane`` (part 1, the copy path against a pinned copy, over
``worker_bench``), ``ttft`` (part 2, ``--ttft``: TTFT and decode with and without the
connector), ``decode`` (``--decode-only``), ``step_timing`` (``--step-timing``), ``engine``
(the engine actor and its profiles), ``common`` (what the engine parts share: profiles, cores,
prompts, the printed figures), ``cli`` (the flags); ``stall`` and ``trace_steps`` are the
diagnostics of a decode's first steps.

Prints ``key=value`` lines, among them ``gpu_load_vs_pinned_copy=``, ``gpu_save_vs_pinned_copy=``
(goal >= 0.9), ``layer_wait_overlapped_ms=`` vs ``layer_compute_ms=`` and, with ``--ttft``,
``ttft_store_warm_vs_cold_4k=`` / ``ttft_store_warm_vs_prefix_hit_4k=`` /
``ttft_cold_overhead_4k=`` (goal <= 1.05), ``decode_overhead_4k=`` (1 - A's decode tok/s over C's,
fresh prompts of that size with ``--decode-tokens`` new tokens each; goal <= 0.03), beside each
``ttft_cold_overhead_noise_4k=`` / ``decode_overhead_noise_4k=`` (C2 against C),
``decode_overhead_null_connector_4k=`` (engine N, whose connector does nothing, against C: what
vLLM's connector hooks cost any connector), and the 16k ones.

Run: ``make gpu-bench`` (both parts) on a GPU machine, or ``python benchmarks/gpu_data_plane.py
--device cpu --quick [--ttft]`` anywhere as a smoke check (small shapes, plain copies).
It starts and stops its own Ray cluster and fleets and leaves nothing in /dev/shm.
"""
