"""The CUDA runtime's strided copy, ``cudaMemcpy2DAsync``, which torch does not expose.

One layer of a step's entries lies in the pool as rows of one layer block, an entry apart: a
strided copy moves all of them on the copy engines in one call (torch's ``copy_`` of a strided
host tensor first packs it on the CPU). It is called through ctypes on the runtime torch
loaded (found among the process's mappings); without one, ``copy_rows`` is unavailable and
every part stays on the gather kernels.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the addresses (unified addressing)


def loaded_runtime(maps: Iterable[str]) -> str | None:
    """The path of the CUDA runtime library among a process's mappings (``/proc/self/maps``
    lines): ``libcudart.so.N``, or a wheel's renamed copy (``libcudart-<hash>.so.N``)."""
    for line in maps:
        at = line.find("/")
        if at < 0:
            continue
        path = line[at:].rstrip("\n").removesuffix(" (deleted)")
        name = os.path.basename(path)
        if name.startswith("libcudart") and ".so" in name:
            return path
    return None


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """The CUDA runtime torch loaded into this process (never another copy: its streams are
    torch's), or None: then every part stays on the gather kernels."""
    try:
        with open("/proc/self/maps") as maps:
            path = loaded_runtime(maps)
        return ctypes.CDLL(path) if path is not None else None
    except OSError as e:
        log.info("no CUDA runtime to call (%s): every part stays on the gather kernels", e)
        return None


@functools.cache
def _memcpy() -> tuple[Any, Any] | None:
    """(``cudaMemcpyAsync``, ``cudaMemcpy2DAsync``) with their argument types declared (plain
    ints pass straight through), or None."""
    runtime = _runtime()
    one, strided = getattr(runtime, "cudaMemcpyAsync", None), getattr(runtime, "cudaMemcpy2DAsync", None)
    if one is None or strided is None:
        return None
    one.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    strided.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                        ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    one.restype = strided.restype = ctypes.c_int
    return one, strided


def has_copy_rows() -> bool:
    """Whether ``copy_rows`` can run here."""
    return _memcpy() is not None


def copy_rows(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int) -> None:
    """Queue ``height`` rows of ``width`` bytes, ``src_pitch`` bytes apart at address ``src``,
    to ``dst_pitch`` apart at ``dst`` on CUDA stream ``stream`` (a handle): one copy on the
    copy engines, one side on the GPU and the other in page-locked host memory. Addresses,
    not tensors: a post of a precomputed plan makes no tensor view for it. Raises RuntimeError
    if CUDA refuses it."""
    calls = _memcpy()
    assert calls is not None, "copy_rows without a CUDA runtime (check has_copy_rows)"
    if height == 1:
        rc = calls[0](dst, src, width, _MEMCPY_DEFAULT, stream)
    else:
        rc = calls[1](dst, dst_pitch, src, src_pitch, width, height, _MEMCPY_DEFAULT, stream)
    if rc != 0:
        raise RuntimeError(f"cudaMemcpy2DAsync of {height} rows of {width} bytes failed: CUDA error {rc}")
