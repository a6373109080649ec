"""How the launcher starts N replicas of a service and wires their addresses into dependents (no processes)."""

from __future__ import annotations

import pytest

from temper.runtime.launcher import Launcher, replica_names, service_of


def test_replica_names():
    assert replica_names("inference", {}) == ["inference"]
    assert replica_names("inference", {"inference": {"replicas": 3}}) == ["inference", "inference-1", "inference-2"]
    assert replica_names("replay", {"replay": {}}) == ["replay"]  # no replicas field: one process
    assert service_of("inference-2") == "inference" and service_of("learner") == "learner"


@pytest.mark.parametrize("bad", [0, -1, "2", 1.5, True])
def test_bad_replica_counts_name_the_key(bad):
    with pytest.raises(ValueError, match=r"\[inference\] replicas"):
        replica_names("inference", {"inference": {"replicas": bad}})


def _flag(args, flag):
    return args[args.index(flag) + 1]


def test_dependents_get_every_replica(tmp_path):
    launcher = Launcher(home=tmp_path / "home")
    addresses = {"inference": ["127.0.0.1:7001", "127.0.0.1:7002"], "replay": ["127.0.0.1:7003"]}
    scheduler = launcher.service_flags("scheduler", {}, None, addresses, "")
    assert _flag(scheduler, "--inference-address") == "ipv4:127.0.0.1:7001,127.0.0.1:7002"
    learner = launcher.service_flags("learner", {}, None, addresses, "")
    assert _flag(learner, "--inference-addresses") == "127.0.0.1:7001,127.0.0.1:7002"
    assert _flag(learner, "--replay-address") == "127.0.0.1:7003"
    # one replica: a plain address (pick_first), as before
    assert _flag(launcher.service_flags("scheduler", {}, None, {"inference": ["127.0.0.1:7001"]}, ""),
                 "--inference-address") == "127.0.0.1:7001"
    # each replica its own port file, data dir and spans; the learner and every replica the same policy folder
    replica = launcher.service_flags("inference-1", {}, None, addresses, "")
    assert _flag(replica, "--port-file").endswith("ports/inference-1.json")
    assert _flag(replica, "--data-dir").endswith("data/inference-1")
    assert _flag(replica, "--policy-dir") == _flag(learner, "--policy-dir") == str(tmp_path / "home/data/shared/policy")
