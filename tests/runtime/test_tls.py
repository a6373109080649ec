"""[auth] tls = true over real gRPC on loopback: the launcher's CA and certificates, a client certificate required.

What gRPC gives a caller the server refuses at the TLS handshake (no certificate, a certificate from another
CA, plaintext): UNAVAILABLE. The handshake fails before any call exists, so there is no status the server
could send (UNAUTHENTICATED is what the token check answers, once a call is through).
"""

import os
import stat
import subprocess
import sys

import grpc
import pytest
from cryptography import x509

from temper.client.sdk import ReplayClient, SchedulerClient
from temper.client.transport import TLS_DIR_ENV, tls_files
from temper.runtime.auth import AuthConfig, binds_exposing_secrets
from temper.runtime.launcher import SERVICES, Launcher
from temper.runtime.rpc import check_health
from temper.runtime.tls import CLIENT, write_certificates
from temper.scheduler.core import JobSpec
from temper.scheduler.store import JobStore
from temper.v1 import replay_pb2, replay_pb2_grpc, scheduler_pb2
from tests.conftest import wait_until

TEMPER = [sys.executable, "-m", "temper.cli.main"]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def _config(tmp_path, extra: str = "") -> str:
    path = tmp_path / "job.toml"
    path.write_text(f"[auth]\ntls = true\n{extra}")
    return str(path)


def test_tls_is_off_by_default_and_a_bad_value_names_the_key():
    assert AuthConfig.from_config({}, "job.toml").tls is False
    with pytest.raises(ValueError, match=r"auth\.tls"):
        AuthConfig.from_config({"auth": {"tls": "maybe"}}, "job.toml")


def test_the_launcher_writes_a_ca_and_one_private_identity_per_service(tmp_path):
    root = write_certificates(tmp_path, SERVICES)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert sorted(p.name for p in root.iterdir()) == sorted([*SERVICES, CLIENT])
    ca = None
    for folder in root.iterdir():
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert sorted(p.name for p in folder.iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
        for f in folder.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
        ca_pem, chain, _ = tls_files(folder)
        ca = ca or ca_pem
        assert ca_pem == ca  # one CA for the whole stack
        cert = x509.load_pem_x509_certificate(chain)
        cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca))
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert folder.name in sans.get_values_for_type(x509.DNSName)
        assert "127.0.0.1" in [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]
    assert not list(tmp_path.rglob("ca.key")), "the CA's private key is never written"


def test_a_sandbox_bind_that_holds_the_tls_keys_is_named(tmp_path, monkeypatch):
    root = write_certificates(tmp_path / "home", ["sandbox"])
    monkeypatch.setenv(TLS_DIR_ENV, str(root / "sandbox"))
    assert binds_exposing_secrets(["/usr", str(tmp_path)]) == [str(tmp_path)]
    assert binds_exposing_secrets([str(root / "sandbox")]) == [str(root / "sandbox")]
    assert binds_exposing_secrets(["/usr", str(tmp_path / "other")]) == []


def _stats(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode | None:
    """The status of one Stats call over a channel with ``credentials`` (None: plaintext); None when it worked."""
    ch = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    with ch:
        try:
            replay_pb2_grpc.ReplayServiceStub(ch).Stats(replay_pb2.StatsRequest(), timeout=10)
        except grpc.RpcError as e:
            return e.code()
    return None


@pytest.mark.slow
def test_replay_with_tls_serves_the_stacks_certificate_holders_only(tmp_path):
    home = tmp_path / "home"
    launcher = Launcher(home=home, config=_config(tmp_path))
    state = launcher.up(["replay"])
    try:
        address = state.services["replay"].address  # the port-file bootstrap worked over a TLS-only port
        client_dir = home / "tls" / CLIENT
        assert state.tls_dir == str(home / "tls") and os.environ[TLS_DIR_ENV] == str(client_dir)
        ca, chain, key = tls_files(client_dir)

        with ReplayClient(address) as good:  # up set $TEMPER_TLS_DIR for this process: the client identity
            assert good.stats().inserts == 0
        assert check_health(address) == "SERVING"
        assert check_health(address, tls_dir="") == "UNREACHABLE"  # a plaintext probe gets no answer

        assert _stats(address, None) == UNAVAILABLE  # plaintext
        assert _stats(address, grpc.ssl_channel_credentials(root_certificates=ca)) == UNAVAILABLE  # no client cert
        other = write_certificates(tmp_path / "other", []) / CLIENT  # a valid certificate of another CA
        o_ca, o_chain, o_key = tls_files(other)
        assert _stats(address, grpc.ssl_channel_credentials(root_certificates=ca, private_key=o_key,
                                                            certificate_chain=o_chain)) == UNAVAILABLE
        # ... and the server is not trusted by a client of the other CA either
        assert _stats(address, grpc.ssl_channel_credentials(root_certificates=o_ca, private_key=key,
                                                            certificate_chain=chain)) == UNAVAILABLE
        with ReplayClient(address, tls_dir=str(other)) as wrong, pytest.raises(grpc.RpcError) as e:
            wrong.stats()
        assert e.value.code() == UNAVAILABLE

        # the service got its own identity, by path: no key on its command line, in the state file or a log
        pid = state.services["replay"].pid
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert f"{TLS_DIR_ENV}={home / 'tls' / 'replay'}".encode() in f.read().split(b"\0")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert key not in f.read()
        for path in [home / "state.json", *(home / "logs").iterdir()]:
            assert key.decode() not in path.read_text(errors="replace"), path

        # another process (the CLI, no variable set) finds the client certificate through --home
        env = {k: v for k, v in os.environ.items() if k != TLS_DIR_ENV}
        run = subprocess.run([*TEMPER, "--home", str(home), "status"], capture_output=True, text=True, timeout=120,
                             env=env)
        assert run.returncode == 0 and "SERVING" in run.stdout, run.stdout + run.stderr
        # the exec probe of a pod with mTLS (deploy/k8s/mtls): it answers only with the certificate
        probe = [sys.executable, "-m", "temper.client.health", address]
        assert subprocess.run(probe, capture_output=True, timeout=60, env={**env, TLS_DIR_ENV: str(client_dir)}
                              ).returncode == 0
        assert subprocess.run(probe, capture_output=True, timeout=60, env=env).returncode == 1
    finally:
        launcher.down()
    assert TLS_DIR_ENV not in os.environ  # down put this process's environment back


@pytest.mark.slow
def test_scheduler_calls_inference_over_mtls_and_down_stops_the_running_job(tmp_path):
    """The scheduler generates through inference (mTLS both ways, the tiny model); `temper down` then stops the
    job the user started, so its saved state is STOPPED and the next `temper up` on this home does not resume it."""
    home = tmp_path / "home"
    toy = Launcher(home=home).config_path.read_text()
    launcher = Launcher(home=home, config=_config(tmp_path, toy))
    state = launcher.up(["inference", "scheduler"])
    try:
        with SchedulerClient(state.services["scheduler"].address) as scheduler:
            scheduler.start_job(JobSpec(job_id="tls-job", steps=1000, prompts_per_step=2, group_size=2,
                                        domains=["toy.copy"], max_policy_lag=2).to_proto())
            wait_until(lambda: scheduler.job("tls-job").groups_published >= 2, 180, interval=0.5,
                       what="the scheduler generated a step through inference")
            assert scheduler.job("tls-job").state == scheduler_pb2.JOB_STATE_RUNNING
        data_dir = home / "data" / "scheduler"
    finally:
        stopped = launcher.down()
    assert "scheduler" in stopped
    saved = {j.spec.job_id: j.state for j in JobStore(data_dir / "jobs.sqlite").jobs()}
    assert saved == {"tls-job": scheduler_pb2.JOB_STATE_STOPPED}


def _pod_certificate(ca, ca_key, dns_name: str):
    """A server certificate naming ``dns_name`` only (as a headless Service's pods get: no IP in it)."""
    import datetime

    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_name)]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(dns_name)]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert, key


@pytest.mark.slow  # a real gRPC server over mTLS
def test_a_replica_dialled_by_ip_is_checked_against_its_services_dns_name(tmp_path):
    """A pod of a headless Service is dialled by IP (discovery resolves dns:///name:port to pod IPs), which its
    certificate cannot name: the channel checks the certificate against the target's DNS name instead."""
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from temper.client.discovery import Replicas
    from temper.client.transport import channel
    from temper.runtime.tls import issue, make_ca, server_credentials, write_identity

    ca, ca_key = make_ca()
    server_dir = write_identity(tmp_path / "inference", ca, *_pod_certificate(ca, ca_key, "inference-pods"))
    client_dir = write_identity(tmp_path / "client", ca, *issue(ca, ca_key, "client"))
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(server_dir))
    server.start()
    try:
        def check(server_name: str):
            ch = channel(f"127.0.0.1:{port}", tls_dir=client_dir, server_name=server_name)
            try:
                return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            except grpc.RpcError as e:
                return e.code()
            finally:
                ch.close()

        assert check("") == grpc.StatusCode.UNAVAILABLE  # checked against 127.0.0.1: not in the certificate
        assert check("inference-pods") == health_pb2.HealthCheckResponse.SERVING
        assert check("scheduler") == grpc.StatusCode.UNAVAILABLE  # another name is not taken
        # what Replicas hands the client factory: the DNS name for a dns: target, nothing for fixed addresses
        made = []
        replicas = Replicas([f"dns:///localhost:{port}", f"127.0.0.1:{port + 1}"],
                            lambda a, name: made.append((a, name)) or grpc.insecure_channel(a))
        replicas.current()
        replicas.close()
        assert (f"127.0.0.1:{port}", "localhost") in made and (f"127.0.0.1:{port + 1}", "") in made
    finally:
        server.stop(None)
