#!/usr/bin/env bash
# NIXL host staging on a GPU host, in one call (from the repository root, as `make gpu-test` runs):
# - the step's end with a save to a same-node and another node's pool, the forward on a side stream
#   and on the legacy default stream, staged (auto: staged exactly where the host has no RDMA port;
#   [legacy_default-off] shows the stall without staging there, an xfail);
# - a staged NIXL load landing after the zeroing queued before it and before its layer computes;
# - staged transfers of GPU memory exact both ways, gather plan and range by range, slabs reused;
# - the shared-memory CUDA paths whose copy code staging shares (HostBufferTransport).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'from ucm_ray.transport.nixl.agent import rdma_ports; print("RDMA ports:", rdma_ports() or "none")'
exec python3 -m pytest -q -p no:cacheprovider -rxXs tests/gpu/test_nixl_staging.py tests/gpu/test_stream_order.py \
    tests/gpu/test_gpu_shm.py "$@"
