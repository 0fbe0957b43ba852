"""The NIXL/UCX listeners of a shard bind the Ray node's address, never every interface.

Ray here runs on loopback (the session fixture): a shard must not open a UCX socket on the
host's external interface, which would expose its pool to the network Ray is kept off.
"""

from __future__ import annotations

import ipaddress

import psutil
import pytest
import ray

from ucm_ray.store.shard.fleet import fleet_status
from ucm_ray.transport import nixl


def _ip(text: str) -> str:
    """``::ffff:127.0.0.1`` (an IPv4 address on an IPv6 socket) is ``127.0.0.1``."""
    addr = ipaddress.ip_address(text)
    mapped = getattr(addr, "ipv4_mapped", None)
    return str(mapped or addr)


def _listening(pid: int) -> list[str]:
    return sorted({_ip(c.laddr.ip) for c in psutil.Process(pid).net_connections(kind="inet")
                   if c.status == psutil.CONN_LISTEN})


def test_shard_listens_only_on_the_ray_node_address(fleet):
    cfg = fleet(num_shards=1, transport="nixl", pool_bytes=8 << 20)
    (stats,) = fleet_status(cfg)["shards"]
    assert stats["node_ip"] == "127.0.0.1"
    ips = _listening(stats["pid"])
    assert ips, "the shard listens for Ray and UCX"
    assert ips == ["127.0.0.1"], f"shard {stats['pid']} listens on {ips}"


def test_client_agent_listens_only_on_the_ray_node_address(ray_cluster):
    @ray.remote(num_cpus=0)
    class Client:
        """An engine-like process of the cluster that starts its NIXL client agent."""

        def start(self) -> int:
            import os

            from ucm_ray.transport.nixl import client_agent

            client_agent()
            return os.getpid()

        def stop(self) -> None:
            from ucm_ray.transport.nixl import shutdown_client_agent

            shutdown_client_agent()

    client = Client.remote()
    try:
        pid = ray.get(client.start.remote(), timeout=120)
        ips = _listening(pid)
        ray.get(client.stop.remote(), timeout=60)
    finally:
        ray.kill(client)
    assert ips == ["127.0.0.1"], f"client agent's process listens on {ips}"


def test_net_devices_name_the_interface_of_the_address():
    assert nixl.ucx_net_devices("127.0.0.1") == "lo" or nixl.ucx_net_devices("127.0.0.1").startswith("lo,")
    assert nixl.ucx_net_devices("203.0.113.77") is None  # on no interface here: UCX's own choice


@pytest.mark.parametrize("preset", ["eth0", "all"])
def test_a_user_setting_wins(monkeypatch, preset):
    monkeypatch.setenv("UCX_NET_DEVICES", preset)
    assert nixl.ucx_net_devices("127.0.0.1") is None
