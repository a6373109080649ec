"""Discovery of a service's replicas: one resolver for the scheduler and the learner, locally and in Kubernetes.

A *target* names one or more servers of one service, as gRPC names them:

* ``host:port``: one server;
* ``ipv4:a:p,b:q`` (or ``ipv6:[a]:p,...``): a fixed set (what ``temper up`` passes for ``replicas = N``);
* ``dns:///name:port``: every address DNS has for ``name``, e.g. a Kubernetes headless Service, whose
  name resolves to the ready pods' IPs; re-resolving picks up pods added or replaced meanwhile.

A channel to a target spreads its calls over every server (round_robin, ``temper.client.transport``);
a caller that must reach each server on its own (the learner pushing weights, a scheduler reading the
lowest serving version) asks ``resolve`` for the addresses, or holds a ``Replicas``.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

C = TypeVar("C")


def _split_host_port(hostport: str, target: str) -> tuple[str, str]:
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{target!r}: {hostport!r} is not host:port")
    return host.strip("[]"), port


def _dns_host_port(target: str) -> tuple[str, str]:
    """(host, port) of a ``dns:`` target; dns://[authority]/host:port: the authority (a DNS server) is gRPC's
    business."""
    name = target[len("dns:"):]
    if name.startswith("//"):
        name = name[2:].split("/", 1)[1] if "/" in name[2:] else ""
    return _split_host_port(name, target)


def resolve(target: str) -> list[str]:
    """The ``host:port`` of every server ``target`` names, sorted (module docstring). A DNS name that does
    not resolve (yet) gives []; a malformed target is a ValueError naming it."""
    target = target.strip()
    if target.startswith("dns:"):
        host, port = _dns_host_port(target)
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror:
            return []
        ips = {info[4][0] for info in infos}
        return sorted(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips)
    for scheme in ("ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme):]
            break
    out = [a.strip() for a in target.split(",") if a.strip()]
    if not out:
        raise ValueError("empty target: name at least one host:port")
    for a in out:
        _split_host_port(a, target)
    return sorted(set(out))


def server_name(target: str) -> str:
    """The name a server found through ``target`` answers to over TLS: the DNS name of a ``dns:`` target (its
    pods are dialled by IP, which no certificate can name: the channel checks the certificate against this
    name instead), "" for fixed addresses (checked as dialled)."""
    target = target.strip()
    return _dns_host_port(target)[0] if target.startswith("dns:") else ""


def resolve_all(targets: Iterable[str]) -> list[str]:
    """Every server of every target in ``targets``, each once, sorted."""
    return sorted({a for t in targets for a in resolve(t)})


def target_of(addresses: list[str]) -> str:
    """One channel target for ``addresses`` (IP literals): the address itself, or ``ipv4:a,b`` / ``ipv6:...``."""
    if not addresses:
        raise ValueError("no addresses")
    if len(addresses) == 1:
        return addresses[0]
    return ("ipv6:" if addresses[0].startswith("[") else "ipv4:") + ",".join(addresses)


class Replicas(Generic[C]):
    """A client per server that ``targets`` name now: re-resolved by ``current()`` at most every ``ttl``
    seconds; a server that appeared gets a client, one that is gone has its client closed.

    ``make_client(address, server_name)``: ``server_name`` is the name its TLS certificate must carry
    (``server_name(target)``: the DNS name of a headless Service for a pod dialled by IP; "" otherwise)."""

    def __init__(self, targets: str | Iterable[str], make_client: Callable[[str, str], C], ttl: float = 1.0):
        self.targets = [targets] if isinstance(targets, str) else list(targets)
        if not self.targets:
            raise ValueError("no targets")
        for t in self.targets:
            if not t.startswith("dns:"):
                resolve(t)  # a malformed fixed target fails here, at start-up
        self._make = make_client
        self._ttl = ttl
        self._clients: dict[str, C] = {}
        self._resolved_at = -float("inf")
        self._lock = threading.Lock()

    def current(self, refresh: bool = False) -> dict[str, C]:
        """``{address: client}`` of every server the targets name (``refresh``: resolve now, whatever the ttl)."""
        with self._lock:
            now = time.monotonic()
            if refresh or now - self._resolved_at >= self._ttl:
                names = {a: server_name(t) for t in self.targets for a in resolve(t)}
                for gone in set(self._clients) - set(names):
                    self._clients.pop(gone).close()
                for a in sorted(names):
                    if a not in self._clients:
                        self._clients[a] = self._make(a, names[a])
                self._resolved_at = now
            return dict(self._clients)

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()
