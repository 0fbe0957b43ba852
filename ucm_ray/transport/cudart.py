"""The CUDA runtime's copies on raw addresses, which torch does not expose: the strided
``cudaMemcpy2DAsync`` and the plain ``cudaMemcpyAsync``.

One layer of a step's entries lies in the pool as rows of one layer block, an entry apart: a
strided copy moves all of them on the copy engines in one call (torch's ``copy_`` of a strided
host tensor first packs it on the CPU). It is called through ctypes on the runtime torch
loaded (found among the process's mappings); without one, ``copy_rows`` is unavailable and
every part stays on the gather kernels.

A few ranges (a decode step's save: a block per layer per request) are cheaper as one async copy
each than as a gather plan; torch's ``copy_`` of two sliced views cost ~20-30 us of host time a
range on an H100 host under the profiler (two views, its dispatcher, a stream lookup), against a
few microseconds for ``cudaMemcpyAsync`` on addresses computed once for all of them (``copy_ranges``).
A gather plan's strips are queued the same way, on addresses computed when it is planned
(``copy_rows``): a post makes no tensor view for them.
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


def clear_last_error() -> None:
    """Reset the calling thread's last CUDA error (``cudaGetLastError``): an API call that failed
    and was handled leaves it set, and torch checks it after its next kernel launch."""
    runtime = _runtime()
    if runtime is not None:
        runtime.cudaGetLastError()


@functools.cache
def _memcpy() -> Any:
    """``cudaMemcpyAsync`` with its argument types declared (plain ints pass straight through),
    or None."""
    runtime = _runtime()
    call = getattr(runtime, "cudaMemcpyAsync", None)
    if call is not None:
        call.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        call.restype = ctypes.c_int
    return call


@functools.cache
def _memcpy_2d() -> Any:
    """``cudaMemcpy2DAsync`` with its argument types declared, or None."""
    runtime = _runtime()
    call = getattr(runtime, "cudaMemcpy2DAsync", None)
    if call is not None:
        call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                         ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        call.restype = ctypes.c_int
    return call


def has_copy_ranges() -> bool:
    """Whether ``copy_ranges`` can run here."""
    return _memcpy() is not None


def copy_ranges(destinations: list[int], sources: list[int], sizes: list[int], stream: int) -> None:
    """Queue one async copy per range (``sizes[i]`` bytes from address ``sources[i]`` to
    ``destinations[i]``; device or page-locked host memory, unified addressing telling the
    direction) on the CUDA stream whose handle is ``stream``. The caller keeps the memory alive
    until the copies ran. Raises RuntimeError at the first copy CUDA refuses (those before it
    are queued)."""
    call = _memcpy()
    assert call is not None, "copy_ranges without a CUDA runtime (check has_copy_ranges)"
    for destination, source, size in zip(destinations, sources, sizes):
        rc = call(destination, source, size, _MEMCPY_DEFAULT, stream)
        if rc != 0:
            raise RuntimeError(f"cudaMemcpyAsync of {size} bytes failed: CUDA error {rc}")


def has_copy_rows() -> bool:
    """Whether ``copy_rows`` can run here."""
    return _memcpy() is not None and _memcpy_2d() is not None


def copy_rows(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int) -> None:
    """Queue ``height`` rows of ``width`` bytes, ``src_pitch`` bytes apart at address ``src``,
    to ``dst_pitch`` apart at ``dst`` on CUDA stream ``stream`` (a handle): one copy on the
    copy engines, one side on the GPU and the other in page-locked host memory (one row: a
    plain ``cudaMemcpyAsync``). Raises RuntimeError if CUDA refuses it."""
    assert has_copy_rows(), "copy_rows without a CUDA runtime (check has_copy_rows)"
    if height == 1:
        rc = _memcpy()(dst, src, width, _MEMCPY_DEFAULT, stream)
    else:
        rc = _memcpy_2d()(dst, dst_pitch, src, src_pitch, width, height, _MEMCPY_DEFAULT, stream)
    if rc != 0:
        raise RuntimeError(f"a copy of {height} rows of {width} bytes failed: CUDA error {rc}")
