"""Remote data path: NIXL (UCX) one-sided READ/WRITE against a shard's pool.

A shard registers its pool once with its own NIXL agent (``NixlPoolExporter``) and
publishes the agent's metadata through the control plane. A client process keeps ONE
NIXL agent for all the shards it talks to (``client_agent``), loads each shard's metadata
once, registers its own buffers once, and then moves a whole batch of ``Ranges`` with a
single NIXL request (``NixlPoolTransport``). Ray never carries these bytes. Importing this
package never needs NIXL; constructing one of its classes does.

``agent`` (the NIXL API, agents and their UCX binding), ``exporter`` (the shard side),
``client`` (the process's one client agent), ``transport`` (the transfers).
"""

from ucm_ray.transport.nixl.agent import NixlUnavailableError, nixl_available, ray_node_ip, ucx_net_devices
from ucm_ray.transport.nixl.client import NixlClientAgent, client_agent, shutdown_client_agent
from ucm_ray.transport.nixl.exporter import NixlPoolExporter
from ucm_ray.transport.nixl.transport import DEFAULT_TIMEOUT_S, NixlPoolTransport

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "NixlClientAgent",
    "NixlPoolExporter",
    "NixlPoolTransport",
    "NixlUnavailableError",
    "client_agent",
    "nixl_available",
    "ray_node_ip",
    "shutdown_client_agent",
    "ucx_net_devices",
]
