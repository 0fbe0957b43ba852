"""Remote data path: NIXL (UCX) one-sided READ/WRITE against a shard's pool.

A shard registers its pool once with its own NIXL agent
(:class:`NixlPoolExporter`) and publishes the agent's metadata (~0.5 KB)
through the control plane. A client process keeps ONE NIXL agent for all the
shards it talks to (:func:`client_agent`), loads each shard's metadata once,
registers its own buffers once, and then moves a whole batch of
:class:`~ucm_ray.transport.base.Ranges` with a single NIXL request
(:class:`NixlPoolTransport`). Ray never carries these bytes.

Facts about NIXL 1.5.1 that shaped this module (measured on a 2-core CPU box):

* The Python package is ``nixl_cu12`` / ``nixl_cu13`` (``nixl`` only exists as
  a separate meta package), so we try all three, lazily: importing this module
  never needs NIXL; constructing one of its classes does.
* The PASSIVE side (the shard) must run UCX's progress thread: without it the
  first transfer never completes (UCX wire-up needs the target to progress;
  between nodes over TCP every RMA does). The Python API hard-codes the
  thread's poll delay to 0, which makes it busy-spin a whole core even when
  idle. We rebuild the agent core with a 1 ms delay: the thread then sleeps in
  ``poll()`` on the worker's event fd and wakes on traffic (idle CPU 0 instead
  of 100 %; bandwidth unchanged).
* On one host UCX picks ``cma`` (process_vm_readv/writev, zero-copy): the
  copy runs synchronously inside the post call (it releases the GIL), so a
  same-node "async" transfer is already done when ``read``/``write`` return.
  Between nodes (TCP/RDMA) it is genuinely asynchronous.
* Prepped descriptor lists (``prep_xfer_dlist`` + ``make_prepped_xfer``) select
  whole descriptors by index, so arbitrary byte ranges (odd sizes, unaligned
  offsets) do not map onto them; page-granular lists would work for aligned
  ops only and would cost one descriptor per page of the pool. Measured, they
  save ~10 us per batch (31 vs 42 us for one 4 KiB op; equal bandwidth for
  2 MiB ops), so each batch uses ``initialize_xfer`` with descriptor lists
  built from plain tuples.
* The client agent runs the (non-spinning) progress thread too, so that
  transfers to other nodes advance while nobody polls; ``wait`` also polls.
* UCX's TCP transport listens on every network interface it finds (one socket
  per interface address), so a shard on a cluster kept on loopback would still
  be reachable from the external network. UCX picks interfaces by
  ``UCX_NET_DEVICES`` (read when the backend's UCX context is created); NIXL's
  ``device_list`` backend parameter appends ``:1`` to every name, which suits
  RDMA ports only (``lo:1`` does not exist). So every agent here is created
  with ``UCX_NET_DEVICES`` naming the interface that carries the Ray node's
  address, plus the host's RDMA ports (they open no sockets), unless the user
  set ``UCX_NET_DEVICES`` already. Shared-memory transports are not network
  devices and stay available.
"""

from __future__ import annotations

import bisect
import importlib
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from itertools import repeat
from types import ModuleType
from typing import Any

import torch

from ucm_ray.transport.base import (
    CompletedTransfer,
    PoolDescriptor,
    PoolTransport,
    Ranges,
    Transfer,
    TransferError,
)

log = logging.getLogger(__name__)

_NIXL_MODULES = ("nixl", "nixl_cu13", "nixl_cu12")
"""Import names of the NIXL Python API, in order of preference."""

PROGRESS_DELAY_US = int(os.environ.get("UCM_RAY_NIXL_PROGRESS_DELAY_US", "1000"))
"""Upper bound on the UCX progress thread's sleep between polls (it also wakes on
events). 0 reproduces NIXL's default busy spin."""

DEFAULT_TIMEOUT_S = 60.0
"""What ``Transfer.wait(None)`` waits at most: a cache must never hang a step forever."""


class NixlUnavailableError(RuntimeError):
    """NIXL (or its UCX backend) is not installed or cannot start in this process."""


_api_lock = threading.Lock()
_api: ModuleType | None = None


def _nixl_api() -> ModuleType:
    """The ``_api`` module of whichever NIXL wheel is installed (imported once, on first use)."""
    global _api
    with _api_lock:
        if _api is not None:
            return _api
        errors = []
        for name in _NIXL_MODULES:
            try:
                _api = importlib.import_module(f"{name}._api")
                log.debug("using NIXL from %s", _api.__file__)
                return _api
            except ImportError as e:
                errors.append(f"{name}: {e}")
        raise NixlUnavailableError(
            "the NIXL transport needs the NIXL Python package (pip install nixl-cu12 on CPU / "
            "CUDA 12 hosts, nixl-cu13 on CUDA 13 hosts); import failed: " + "; ".join(errors))


def nixl_available() -> bool:
    """Whether NIXL can be imported here (for callers that pick a transport)."""
    try:
        _nixl_api()
        return True
    except NixlUnavailableError:
        return False


def _rdma_ports(root: str = "/sys/class/infiniband") -> list[str]:
    """UCX names (``mlx5_0:1``) of this host's RDMA ports."""
    try:
        devices = sorted(os.listdir(root))
    except OSError:
        return []
    ports = []
    for dev in devices:
        try:
            ports += [f"{dev}:{p}" for p in sorted(os.listdir(os.path.join(root, dev, "ports")), key=_port_key)]
        except OSError:
            continue
    return ports


def _port_key(p: str) -> tuple[int, str]:
    return (int(p), "") if p.isdigit() else (1 << 30, p)


def ucx_net_devices(bind_ip: str | None) -> str | None:
    """The ``UCX_NET_DEVICES`` that keeps UCX's sockets on ``bind_ip``'s interface.

    None (leave UCX to its defaults) when the user set ``UCX_NET_DEVICES``, when
    there is no address, or when no interface of this host carries it (a NAT'd
    address: then restricting would only break transfers).
    """
    if os.environ.get("UCX_NET_DEVICES") or not bind_ip:
        return None
    import ipaddress

    import psutil

    try:
        want = ipaddress.ip_address(bind_ip)
    except ValueError:
        return None
    for ifname, addrs in sorted(psutil.net_if_addrs().items()):
        for a in addrs:
            try:
                if ipaddress.ip_address(a.address.split("%")[0]) == want:
                    return ",".join([ifname] + _rdma_ports())
            except ValueError:  # MAC addresses and the like
                continue
    return None


def ray_node_ip() -> str | None:
    """The address of the Ray node this process belongs to (None outside Ray)."""
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:
        return str(ray.util.get_node_ip_address())
    except Exception:
        return None


_env_lock = threading.Lock()


def _create_ucx_backend(agent: Any, name: str, bind_ip: str | None) -> None:
    """``create_backend("UCX")`` with UCX's network interfaces limited to ``bind_ip``'s."""
    devices = ucx_net_devices(bind_ip)
    if bind_ip and devices is None and not os.environ.get("UCX_NET_DEVICES"):
        log.warning("NIXL agent %s: no interface here has the address %s; UCX listens on every "
                    "interface (set UCX_NET_DEVICES to choose)", name, bind_ip)
    if devices is None:
        agent.create_backend("UCX")
        return
    with _env_lock:  # UCX reads the variable while it creates its context, in this call
        os.environ["UCX_NET_DEVICES"] = devices
        try:
            agent.create_backend("UCX")
        finally:
            os.environ.pop("UCX_NET_DEVICES", None)
    log.debug("NIXL agent %s: UCX_NET_DEVICES=%s (for %s)", name, devices, bind_ip)


def _make_agent(name: str, bind_ip: str | None = None) -> Any:
    """A NIXL agent with the UCX backend and a progress thread that does not spin.

    ``nixl_agent.__init__`` hard-codes ``pthrDelay = 0`` (busy spin). We build it
    with no backend, swap in a core agent built from a config that carries our
    delay, and only then create the UCX backend (which starts the thread).
    UCX's sockets bind ``bind_ip``'s interface (default: the Ray node's address).
    """
    if bind_ip is None:
        bind_ip = ray_node_ip()
    api = _nixl_api()
    sync = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW  # several threads may post/poll
    try:
        agent = api.nixl_agent(name, api.nixl_agent_config(
            enable_prog_thread=True, enable_listen_thread=False, backends=[], sync_mode=sync))
    except Exception as e:  # e.g. "No plugins available"
        raise NixlUnavailableError(f"NIXL could not create agent {name!r}: {e}") from e
    if "UCX" not in agent.get_plugin_list():
        raise NixlUnavailableError(
            f"NIXL has no UCX plugin here (plugins: {agent.get_plugin_list()})")
    binding = getattr(api, "nixlBind", None)
    if binding is not None and hasattr(agent, "agent") and not agent.backends:
        cfg = binding.nixlAgentConfig()
        cfg.useProgThread = True
        cfg.useListenThread = False
        cfg.syncMode = sync.value
        cfg.pthrDelay = PROGRESS_DELAY_US
        cfg.lthrDelay = 100000
        cfg.captureTelemetry = False
        agent.agent = binding.nixlAgent(name, cfg)
    else:  # a future NIXL changed its internals: correct, but the thread will spin
        log.warning("cannot set the NIXL progress-thread delay; its thread may busy-spin")
    try:
        _create_ucx_backend(agent, name, bind_ip)
    except Exception as e:
        raise NixlUnavailableError(f"NIXL could not start its UCX backend: {e}") from e
    return agent


def _mem_type(t: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of a tensor's memory (CPU memory uses device 0)."""
    if t.device.type == "cpu":
        return "DRAM", 0
    if t.device.type == "cuda":
        return "VRAM", t.device.index if t.device.index is not None else torch.cuda.current_device()
    raise ValueError(f"NIXL cannot move {t.device.type} memory (only cpu and cuda)")


# ---------------------------------------------------------------------------------------
# shard side
# ---------------------------------------------------------------------------------------


class NixlPoolExporter:
    """Makes one shard's pool readable/writable by remote NIXL agents.

    Lives in the shard process for the life of the pool. Registers the pool
    once; clients then reach it one-sidedly with the published metadata, so the
    shard does no per-transfer work (its UCX progress thread handles wire-up).
    """

    def __init__(self, pool: torch.Tensor, agent_name: str, *, bind_ip: str | None = None) -> None:
        if pool.device.type != "cpu":
            # PoolDescriptor carries no memory type / device for the pool yet.
            raise ValueError("NixlPoolExporter: only host-memory (cpu) pools are supported")
        if not pool.is_contiguous() or pool.numel() == 0:
            raise ValueError("NixlPoolExporter: the pool must be a non-empty contiguous tensor")
        self._pool: torch.Tensor | None = pool
        self._agent = _make_agent(agent_name, bind_ip)
        self.agent_name = agent_name
        self.base_addr = pool.data_ptr()
        self.pool_bytes = pool.numel() * pool.element_size()
        try:
            self._reg = self._agent.register_memory([(self.base_addr, self.pool_bytes, 0, "")], "DRAM")
        except Exception as e:
            raise NixlUnavailableError(f"NIXL could not register the {self.pool_bytes}-byte pool: {e}") from e
        self._metadata: bytes = self._agent.get_agent_metadata()
        log.info("NIXL agent %s exports %d bytes at 0x%x (metadata %d B)", agent_name,
                 self.pool_bytes, self.base_addr, len(self._metadata))

    def metadata(self) -> bytes:
        """What a client passes to ``add_remote_agent`` (taken once the pool is registered)."""
        if self._pool is None:
            raise RuntimeError(f"NixlPoolExporter {self.agent_name} is closed")
        return self._metadata

    def descriptor(self, shard_id: str, node_id: str, shm_path: str | None = None, *,
                   incarnation: int = 0) -> PoolDescriptor:
        """The PoolDescriptor clients need to reach this pool."""
        return PoolDescriptor(shard_id=shard_id, node_id=node_id, pool_bytes=self.pool_bytes,
                              shm_path=shm_path, nixl_agent=self.agent_name,
                              nixl_metadata=self.metadata(), pool_base_addr=self.base_addr,
                              incarnation=incarnation)

    def close(self) -> None:
        """Deregister the pool and drop the agent and our reference to the pool tensor.

        Dropping the tensor matters: the owner's ``mmap.close()`` refuses while views live.
        Close clients first; a client that still holds our metadata gets errors, not bytes.
        """
        if self._pool is None:
            return
        try:
            self._agent.deregister_memory(self._reg)
        except Exception:
            log.warning("NIXL agent %s: deregistering the pool failed", self.agent_name, exc_info=True)
        self._reg = None
        self._agent = None  # joins the progress thread, closes UCX
        self._pool = None
        log.info("NIXL agent %s closed", self.agent_name)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


# ---------------------------------------------------------------------------------------
# client side
# ---------------------------------------------------------------------------------------


@dataclass
class _Region:
    """One registered local memory range, shared by the transports that registered it."""

    start: int
    nbytes: int
    mem_type: str
    dev: int
    reg: Any
    keep: Any  # the storage: keeps the memory alive while NIXL may touch it
    refs: int = 0

    @property
    def end(self) -> int:
        return self.start + self.nbytes


@dataclass
class _Remote:
    name: str
    metadata: bytes
    refs: int = 0


class NixlClientAgent:
    """The one NIXL agent a client process uses for every remote pool.

    One agent per process keeps UCX workers, memory registrations and
    connections shared: registering a KV cache once serves every shard.
    Registrations and remote agents are reference-counted so that transports
    can be opened and closed independently.
    """

    def __init__(self, name: str | None = None, *, bind_ip: str | None = None) -> None:
        self.name = name or f"ucmr-client-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.agent = _make_agent(self.name, bind_ip)
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._regions: dict[tuple[str, int, int, int], _Region] = {}
        self._remotes: dict[str, _Remote] = {}
        self._closed = False
        log.info("NIXL client agent %s started", self.name)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- local memory ------------------------------------------------------------------

    def acquire_region(self, tensor: torch.Tensor) -> _Region:
        """Register the whole storage under ``tensor`` (once per storage) and take a reference."""
        mem_type, dev = _mem_type(tensor)
        storage = tensor.untyped_storage()
        start, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:
            raise ValueError("register_local: empty tensor")
        key = (mem_type, dev, start, nbytes)
        with self._lock:
            self._check_open()
            region = self._regions.get(key)
            if region is None:
                try:
                    reg = self.agent.register_memory([(start, nbytes, dev, "")], mem_type)
                except Exception as e:
                    raise TransferError(f"NIXL could not register {nbytes} bytes of {mem_type}: {e}") from e
                region = _Region(start, nbytes, mem_type, dev, reg, storage)
                self._regions[key] = region
                log.debug("NIXL %s: registered %s:%d [0x%x, +%d)", self.name, mem_type, dev, start, nbytes)
            region.refs += 1
            return region

    def release_region(self, region: _Region) -> None:
        with self._lock:
            region.refs -= 1
            key = (region.mem_type, region.dev, region.start, region.nbytes)
            if region.refs <= 0 and self._regions.get(key) is region:
                del self._regions[key]
                self._deregister(region)

    def _deregister(self, region: _Region) -> None:
        try:
            self.agent.deregister_memory(region.reg)
        except Exception:
            log.warning("NIXL %s: deregister failed", self.name, exc_info=True)

    # -- remote agents -----------------------------------------------------------------

    def add_remote(self, metadata: bytes, expected_name: str | None) -> str:
        """Load a shard's metadata (once per agent name) and take a reference to it."""
        with self._lock:
            self._check_open()
            known = self._remotes.get(expected_name) if expected_name is not None else None
            if known is not None and known.metadata == metadata:
                known.refs += 1
                return known.name
            if known is not None:  # same name, new metadata: a restarted shard; drop the stale one
                try:
                    self.agent.remove_remote_agent(known.name)
                except Exception:
                    log.debug("NIXL %s: invalidating stale %s failed", self.name, known.name, exc_info=True)
            try:
                raw = self.agent.add_remote_agent(metadata)
            except Exception as e:
                raise TransferError(f"NIXL could not load metadata of agent {expected_name!r}: {e}") from e
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            if expected_name is not None and name != expected_name:
                raise ValueError(f"NIXL metadata is for agent {name!r}, descriptor says {expected_name!r}")
            remote = self._remotes.get(name)
            if remote is None or remote.metadata != metadata:  # new, or a restarted shard
                remote = _Remote(name, metadata, (remote.refs if remote else 0))
                self._remotes[name] = remote
            remote.refs += 1
            return name

    def remove_remote(self, name: str) -> None:
        with self._lock:
            remote = self._remotes.get(name)
            if remote is None:
                return
            remote.refs -= 1
            if remote.refs <= 0:
                del self._remotes[name]
                try:
                    self.agent.remove_remote_agent(name)
                except Exception:
                    log.warning("NIXL %s: removing remote agent %s failed", self.name, name, exc_info=True)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"NIXL client agent {self.name} is closed")

    def close(self) -> None:
        """Forget all remotes and registrations (transports using this agent stop working)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for name in list(self._remotes):
                try:
                    self.agent.remove_remote_agent(name)
                except Exception:
                    pass
            self._remotes.clear()
            for region in self._regions.values():
                self._deregister(region)
            self._regions.clear()
            self.agent = None
        log.info("NIXL client agent %s closed", self.name)


_client_lock = threading.Lock()
_client: NixlClientAgent | None = None
_inherited: list[NixlClientAgent] = []
"""Agents inherited through fork: never destroyed in the child (their progress threads do
not exist here, and tearing down the parent's UCX state from a child is unsafe)."""


def client_agent() -> NixlClientAgent:
    """This process's shared client agent, created on first use (thread-safe, fork-aware)."""
    global _client
    with _client_lock:
        if _client is not None and _client.pid != os.getpid():
            _inherited.append(_client)  # after fork the parent's UCX state is unusable
            _client = None
        if _client is None or _client.closed:
            _client = NixlClientAgent()
        return _client


def shutdown_client_agent() -> None:
    """Close the shared client agent (tests, process exit); the next use starts a new one."""
    global _client
    with _client_lock:
        if _client is not None and _client.pid == os.getpid():
            _client.close()
        _client = None


class _NixlTransfer(Transfer):
    """One or two posted NIXL requests (one per local memory type) for one batch.

    Handles are released as soon as the outcome is known, on success and on
    failure, so neither UCX requests nor memory pins leak.
    """

    def __init__(self, agent: Any, what: tuple[str, int, str], default_timeout_s: float | None) -> None:
        self._agent = agent
        self._what = what
        self._default_timeout_s = default_timeout_s
        self._pending: list[Any] = []
        self._error: str | None = None
        self._lock = threading.Lock()

    def _add(self, handle: Any, state: str) -> None:
        if state == "DONE":
            self._release(handle)
        elif state == "PROC":
            self._pending.append(handle)
        else:
            self._release(handle)
            self._fail("NIXL rejected the post")

    def _fail(self, why: str) -> None:
        if self._error is None:
            op_name, n_ops, shard = self._what  # formatted only on failure: posting stays cheap
            self._error = f"NIXL {op_name} of {n_ops} ops with shard {shard}: {why}"
            log.warning("%s", self._error)

    def _release(self, handle: Any) -> None:
        try:
            handle.release()
        except Exception as e:  # could not cancel an in-flight request; NIXL frees it later
            self._fail(f"releasing the request failed ({e})")

    def _poll(self) -> bool:
        """Progress and collect finished requests; True when none is pending. Caller holds the lock."""
        still = []
        for h in self._pending:
            try:
                state = self._agent.check_xfer_state(h)
            except Exception as e:
                state = "ERR"
                self._fail(str(e))
            if state == "PROC":
                still.append(h)
            else:
                if state != "DONE":
                    self._fail("NIXL reported an error")
                self._release(h)
        self._pending = still
        return not still

    def done(self) -> bool:
        with self._lock:
            return self._poll()

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every request finished; ``None`` means the transport's default timeout.

        Raises TransferError on failure or timeout. On timeout the requests are
        released, which makes NIXL drain them (up to NIXL_UCX_REQUEST_DRAIN_TIMEOUT,
        10 s) so that no late completion touches deregistered memory; the
        destination bytes are garbage either way.
        """
        if timeout_s is None:
            timeout_s = self._default_timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        spins = 0
        while True:
            with self._lock:  # held per poll only, so done() from another thread stays cheap
                if self._poll():
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    for h in self._pending:
                        self._release(h)
                    self._pending = []
                    self._fail(f"timed out after {timeout_s} s")
                    break
            spins += 1
            # Spin briefly (completions are usually near), then back off to <= 1 ms.
            time.sleep(0 if spins < 64 else min(1e-3, 1e-5 * (spins - 63)))
        if self._error is not None:
            raise TransferError(self._error)


class NixlPoolTransport(PoolTransport):
    """Moves bytes between this process's registered tensors and one remote shard pool.

    ``read``/``write`` validate the whole batch first (nothing moves if any op
    is wrong), then post it as one NIXL request per local memory type.
    """

    name = "nixl"

    def __init__(self, desc: PoolDescriptor, agent: NixlClientAgent | None = None, *,
                 default_timeout_s: float | None = DEFAULT_TIMEOUT_S) -> None:
        if not desc.nixl_metadata or not desc.nixl_agent:
            raise ValueError(f"shard {desc.shard_id} publishes no NIXL agent (was it started "
                             "with transport='shm'?)")
        if desc.pool_bytes <= 0 or desc.pool_base_addr <= 0:
            raise ValueError(f"shard {desc.shard_id}: bad pool descriptor "
                             f"(bytes={desc.pool_bytes}, base=0x{desc.pool_base_addr:x})")
        self._client = agent if agent is not None else client_agent()
        self.desc = desc
        self.default_timeout_s = default_timeout_s
        self._remote = self._client.add_remote(desc.nixl_metadata, desc.nixl_agent)
        self._regions: dict[tuple[str, int, int, int], _Region] = {}
        self._starts: dict[tuple[str, int], list[int]] = {}  # sorted region starts per memory
        self._ends: dict[tuple[str, int], list[int]] = {}
        self._lock = threading.Lock()
        self._closed = False
        log.debug("NIXL transport to shard %s (agent %s, %d bytes)", desc.shard_id, self._remote,
                  desc.pool_bytes)

    # -- registration ------------------------------------------------------------------

    def register_local(self, tensor: torch.Tensor) -> None:
        """Register the storage under ``tensor`` with NIXL (idempotent per storage)."""
        mem_type, dev = _mem_type(tensor)
        storage = tensor.untyped_storage()
        key = (mem_type, dev, storage.data_ptr(), storage.nbytes())
        with self._lock:
            self._check_open()
            if key in self._regions:
                return
            self._regions[key] = self._client.acquire_region(tensor)
            self._reindex()

    def _reindex(self) -> None:
        by_mem: dict[tuple[str, int], list[_Region]] = {}
        for r in self._regions.values():
            by_mem.setdefault((r.mem_type, r.dev), []).append(r)
        self._starts, self._ends = {}, {}
        for mem, rs in by_mem.items():
            rs.sort(key=lambda r: r.start)
            self._starts[mem] = [r.start for r in rs]
            self._ends[mem] = [r.end for r in rs]

    # -- data movement -----------------------------------------------------------------

    def read(self, ranges: Ranges) -> Transfer:
        return self._post("READ", ranges)

    def write(self, ranges: Ranges) -> Transfer:
        return self._post("WRITE", ranges)

    def _check_ops(self, op_name: str, ranges: Ranges) -> dict[tuple[str, int], tuple[list, list]]:
        """NIXL descriptor rows (local, remote) per local memory; ValueError on any bad range
        (nothing moves then). Each local buffer is checked once, not each range.

        Rows are plain tuples: building a descriptor list from them is ~5x faster than
        from a numpy array (1.6 vs 4.7 us for 16 ops, 31 vs 171 us for 512).
        """
        ranges.check(self.desc.pool_bytes, f"{op_name}: shard {self.desc.shard_id}'s pool")
        groups: dict[tuple[str, int], tuple[list, list]] = {}
        for home, buffer in enumerate(ranges.buffers):
            mine = (ranges.buffer_index == home) & (ranges.sizes > 0)
            if not mine.any():
                continue
            mem = _mem_type(buffer)
            addr, n = buffer.data_ptr(), buffer.numel()
            starts = self._starts.get(mem)
            j = bisect.bisect_right(starts, addr) - 1 if starts else -1
            if (j < 0 or addr + n > self._ends[mem][j]) and not self._covered(mem, addr, n):
                raise ValueError(f"{op_name}: local buffer {mem[0]}:{mem[1]} [0x{addr:x}, +{n}) is "
                                 "not inside memory registered with register_local()")
            sizes = ranges.sizes[mine].tolist()
            rows = groups.setdefault(mem, ([], []))
            rows[0].extend(zip((addr + ranges.local_offsets[mine]).tolist(), sizes, repeat(mem[1])))
            rows[1].extend(zip((self.desc.pool_base_addr + ranges.pool_offsets[mine]).tolist(), sizes, repeat(0)))
        return groups

    def _covered(self, mem: tuple[str, int], addr: int, n: int) -> bool:
        """Slow path for overlapping registrations (bisect only looks at the nearest start)."""
        return any(r.start <= addr and addr + n <= r.end for r in self._regions.values()
                   if (r.mem_type, r.dev) == mem)

    def _post(self, op_name: str, ranges: Ranges) -> Transfer:
        with self._lock:
            self._check_open()
            groups = self._check_ops(op_name, ranges)
        if not groups:
            return CompletedTransfer()
        agent = self._client.agent
        xfer = _NixlTransfer(agent, (op_name, len(ranges), self.desc.shard_id), self.default_timeout_s)
        for (mem_type, _dev), (local, remote) in groups.items():
            try:
                handle = agent.initialize_xfer(op_name, agent.get_xfer_descs(local, mem_type),
                                               agent.get_xfer_descs(remote, "DRAM"), self._remote)
            except Exception as e:
                xfer._fail(f"could not create the request ({type(e).__name__}: {e})")
                break
            try:
                state = agent.transfer(handle)
            except Exception as e:  # e.g. the shard died: nixlRemoteDisconnectError
                xfer._release(handle)
                xfer._fail(f"could not post ({type(e).__name__}: {e})")
                break
            xfer._add(handle, state)
        return xfer

    # -- teardown ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"NIXL transport to shard {self.desc.shard_id} is closed")
        if self._client.closed:
            raise RuntimeError(f"NIXL client agent {self._client.name} is closed")

    def close(self) -> None:
        """Drop our references to the remote agent and our registrations.

        Wait for (or abandon) this transport's transfers first: their memory is
        deregistered here once no other transport of the process uses it.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            regions, self._regions = list(self._regions.values()), {}
            self._starts, self._ends = {}, {}
        self._client.remove_remote(self._remote)
        for r in regions:
            self._client.release_region(r)
