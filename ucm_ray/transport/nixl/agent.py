"""The NIXL API and its agents: found lazily, started with the UCX backend bound to the Ray node's interface.

Facts about NIXL 1.5.1 that shaped this module:

* The Python package is ``nixl_cu12`` / ``nixl_cu13`` (``nixl`` only exists as
  a separate meta package), so we try all three, lazily: importing this module
  never needs NIXL; constructing an agent does.
* The PASSIVE side (the shard) must run UCX's progress thread: without it the
  first transfer never completes (UCX wire-up needs the target to progress;
  between nodes over TCP every RMA does). The Python API hard-codes the
  thread's poll delay to 0, which makes it busy-spin a whole core even when
  idle. We rebuild the agent core with a 1 ms delay: the thread then sleeps in
  ``poll()`` on the worker's event fd and wakes on traffic (an idle agent then
  costs no CPU, and bandwidth is unchanged).
* The client agent runs the (non-spinning) progress thread too, so that
  transfers to other nodes advance while nobody polls.
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

import importlib
import logging
import os
import threading
from types import ModuleType
from typing import Any

import torch

log = logging.getLogger(__name__)

_NIXL_MODULES = ("nixl", "nixl_cu13", "nixl_cu12")
"""Import names of the NIXL Python API, in order of preference."""

PROGRESS_DELAY_US = int(os.environ.get("UCM_RAY_NIXL_PROGRESS_DELAY_US", "1000"))
"""Upper bound on the UCX progress thread's sleep between polls (it also wakes on
events). 0 reproduces NIXL's default busy spin."""


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


def rdma_ports(root: str = "/sys/class/infiniband") -> list[str]:
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
                    return ",".join([ifname] + rdma_ports())
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
    except Exception:  # noqa: BLE001 -- Ray could not tell: UCX picks its own address
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


def make_agent(name: str, bind_ip: str | None = None) -> Any:
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


def memory_of(t: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of a tensor's memory (CPU memory uses device 0)."""
    if t.device.type == "cpu":
        return "DRAM", 0
    if t.device.type == "cuda":
        return "VRAM", t.device.index if t.device.index is not None else torch.cuda.current_device()
    raise ValueError(f"NIXL cannot move {t.device.type} memory (only cpu and cuda)")


# ---------------------------------------------------------------------------------------
