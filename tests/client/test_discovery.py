"""The one resolver of inference replicas (temper.client.discovery), used by the scheduler and the learner."""

from __future__ import annotations

import pytest

from temper.client.discovery import Replicas, resolve, resolve_all, target_of


def test_fixed_targets_resolve_to_their_addresses():
    assert resolve("127.0.0.1:5") == ["127.0.0.1:5"]
    assert resolve("ipv4:127.0.0.1:6,127.0.0.1:5") == ["127.0.0.1:5", "127.0.0.1:6"]
    assert resolve("ipv6:[::1]:7") == ["[::1]:7"]
    assert resolve_all(["127.0.0.1:5", "ipv4:127.0.0.1:5,127.0.0.1:6"]) == ["127.0.0.1:5", "127.0.0.1:6"]


def test_dns_targets_resolve_through_dns():
    # localhost is in /etc/hosts: every address it has, with the port (a headless Service: one per ready pod)
    found = resolve("dns:///localhost:50051")
    assert found and all(a.endswith(":50051") for a in found)
    assert "127.0.0.1:50051" in found or "[::1]:50051" in found
    assert resolve("dns:localhost:50051") == found
    assert resolve("dns://8.8.8.8/localhost:50051") == found  # the authority is gRPC's; the name is the same
    assert resolve("dns:///no-such-host.invalid:50051") == []  # not resolvable (yet): no replica, no crash


@pytest.mark.parametrize("bad", ["", "ipv4:", "127.0.0.1", "dns:///localhost", "a:b"])
def test_malformed_targets_are_named(bad):
    with pytest.raises(ValueError, match="host:port|empty target"):
        resolve(bad)


def test_target_of_addresses():
    assert target_of(["127.0.0.1:5"]) == "127.0.0.1:5"
    assert target_of(["127.0.0.1:5", "127.0.0.1:6"]) == "ipv4:127.0.0.1:5,127.0.0.1:6"
    assert target_of(["[::1]:5", "[::1]:6"]) == "ipv6:[::1]:5,[::1]:6"
    with pytest.raises(ValueError):
        target_of([])


class _Client:
    def __init__(self, address, server_name):
        self.address, self.server_name, self.closed = address, server_name, False

    def close(self):
        self.closed = True


def test_replicas_follow_the_resolved_set(tmp_path, monkeypatch):
    import temper.client.discovery as discovery

    names = {"dns:///pods:1": ["10.0.0.1:1", "10.0.0.2:1"]}
    monkeypatch.setattr(discovery, "resolve", lambda t: names[t])
    replicas = Replicas("dns:///pods:1", _Client, ttl=3600)
    first = replicas.current()
    assert sorted(first) == ["10.0.0.1:1", "10.0.0.2:1"]
    names["dns:///pods:1"] = ["10.0.0.2:1", "10.0.0.3:1"]  # a pod replaced, another added
    assert replicas.current() == first  # within the ttl: no new lookup
    now = replicas.current(refresh=True)
    assert sorted(now) == ["10.0.0.2:1", "10.0.0.3:1"]
    assert first["10.0.0.1:1"].closed and now["10.0.0.2:1"] is first["10.0.0.2:1"]  # kept, not reopened
    replicas.close()
    assert all(c.closed for c in now.values())


def test_replicas_refuse_a_malformed_fixed_target():
    with pytest.raises(ValueError, match="host:port"):
        Replicas(["127.0.0.1"], _Client)


def test_the_tls_name_of_a_target():
    from temper.client.discovery import server_name

    assert server_name("dns:///inference-pods:50051") == "inference-pods"
    assert server_name("dns://10.0.0.10/inference-pods.temper.svc:50051") == "inference-pods.temper.svc"
    assert server_name("127.0.0.1:5") == "" and server_name("ipv4:10.0.0.1:5,10.0.0.2:5") == ""
    with pytest.raises(ValueError, match="host:port"):
        server_name("dns:///inference-pods")
