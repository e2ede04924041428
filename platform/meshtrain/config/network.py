"""Network addresses as the settings and Ray name them: what a peer or Prometheus dials."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    @property
    def target(self) -> str:
        """host:port, with an IPv6 host in brackets."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def advertised_host(bind_address: str, node_ip: str) -> str:
    """The address a peer should dial: the node's IP when listening on every interface."""
    return node_ip if bind_address in ("0.0.0.0", "::") else bind_address
