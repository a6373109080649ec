"""Kafka over mutual TLS, as Temper's clients speak it to a Strimzi listener with ``authentication: tls``
(``TEMPER_KAFKA_TLS_DIR``: the cluster CA's ``ca.crt``, the KafkaUser's ``user.crt`` / ``user.key``). The
embedded broker (Tansu 0.6.0) cannot serve TLS itself, so a TLS front that requires a client certificate
from the CA relays to it here and Tansu advertises the front: every byte the clients exchange goes over
TLS. Producer, group consumer and admin client work through it; a client without a certificate, with one
from another CA, or in plaintext gets nothing; settings that cannot be used are named before any
connection (and stop a service at start-up)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from kafka import KafkaProducer
from kafka.errors import KafkaError

from temper.runtime import kafka
from temper.runtime.broker import start_broker_on_free_port
from temper.runtime.tls import issue, make_ca, write_identity
from temper.v1 import common_pb2
from tests.conftest import wait_until

pytestmark = pytest.mark.slow  # a broker and a TLS front


class TlsFront:
    """Accepts TLS on 127.0.0.1:<port 0> (client certificate required, checked against ``ca_file``) and relays
    each connection to ``target``; runs its own event loop in a thread."""

    def __init__(self, cert: Path, key: Path, ca_file: Path):
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(ca_file))
        self.context.verify_mode = ssl.CERT_REQUIRED
        self.context.load_cert_chain(str(cert), str(key))
        self.target: tuple[str, int] | None = None
        self.loop = asyncio.new_event_loop()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def start():
            self.server = await asyncio.start_server(self._relay, sock=self.sock, ssl=self.context,
                                                     ssl_handshake_timeout=5)
            ready.set()
        self.loop.run_until_complete(start())
        self.loop.run_forever()

    async def _relay(self, reader, writer) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return

        async def pipe(src, dst):
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, ssl.SSLError):
                pass
            finally:
                dst.close()
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _kafka_dir(folder: Path, ca, cert, key) -> Path:
    """A Strimzi-shaped folder: ca.crt, user.crt, user.key."""
    write_identity(folder, ca, cert, key)
    (folder / "tls.crt").rename(folder / "user.crt")
    (folder / "tls.key").rename(folder / "user.key")
    return folder


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory):
    root = tmp_path_factory.mktemp("kafka-tls")
    ca, ca_key = make_ca("test Kafka cluster CA")
    broker_id = write_identity(root / "broker", ca, *issue(ca, ca_key, "broker"))
    client = _kafka_dir(root / "client", ca, *issue(ca, ca_key, "temper-replay"))
    other_ca, other_key = make_ca("another CA")
    stranger = _kafka_dir(root / "stranger", other_ca, *issue(other_ca, other_key, "temper-replay"))
    shutil.copy(client / "ca.crt", stranger / "ca.crt")  # trusts the brokers, but its certificate is not theirs
    no_cert = root / "no-cert"
    no_cert.mkdir()
    shutil.copy(client / "ca.crt", no_cert / "ca.crt")
    front = TlsFront(broker_id / "tls.crt", broker_id / "tls.key", broker_id / "ca.crt")
    proc, port = start_broker_on_free_port(root / "broker.log", advertised=f"127.0.0.1:{front.port}")
    front.target = ("127.0.0.1", port)
    yield {"bootstrap": f"127.0.0.1:{front.port}", "client": client, "stranger": stranger, "no_cert": no_cert,
           "front": front}
    proc.kill()
    proc.wait()
    front.close()


@pytest.fixture
def kafka_env(monkeypatch):
    def use(folder: Path | None):
        monkeypatch.delenv(kafka.SASL_USERNAME_ENV, raising=False)
        if folder is None:
            monkeypatch.delenv(kafka.TLS_DIR_ENV, raising=False)
        else:
            monkeypatch.setenv(kafka.TLS_DIR_ENV, str(folder))
    return use


def test_producer_group_consumer_and_admin_over_mutual_tls(tls_broker, kafka_env):
    kafka_env(tls_broker["client"])
    bootstrap = tls_broker["bootstrap"]
    kafka.ensure_topics(bootstrap, (kafka.SCORED,))
    producer = kafka.ProtoProducer(bootstrap, client_id="tls-test")
    sent = [common_pb2.RolloutGroup(group_id=f"tls/{i}", job_id="tls") for i in range(5)]
    for g in sent:
        producer.send(kafka.SCORED, g.group_id, g).get(timeout=30)
    producer.close()
    got: list[str] = []
    consumer = kafka.ProtoConsumer(bootstrap, kafka.SCORED, "tls-group", common_pb2.RolloutGroup,
                                   lambda g: got.append(g.group_id)).start()
    try:
        wait_until(lambda: len(got) >= 5, 60, what="the messages back over TLS")
    finally:
        consumer.stop()
    assert got == [g.group_id for g in sent]
    assert kafka.messages_in(bootstrap, kafka.SCORED) == 5


@pytest.mark.parametrize("who", ["no_cert", "stranger", "plaintext"])
def test_a_client_the_front_does_not_admit_gets_nothing(tls_broker, kafka_env, who):
    kafka_env(None if who == "plaintext" else tls_broker[who])
    with pytest.raises(KafkaError):
        KafkaProducer(bootstrap_servers=tls_broker["bootstrap"], max_block_ms=3000, request_timeout_ms=3000,
                      bootstrap_timeout_ms=3000,
                      **kafka.client_security()).send(kafka.SCORED, b"x").get(timeout=5)


def test_settings_that_cannot_be_used_are_named(tmp_path):
    assert kafka.client_security({}) == {}
    with pytest.raises(ValueError, match=f"{kafka.TLS_DIR_ENV}: .* has no ca.crt"):
        kafka.client_security({kafka.TLS_DIR_ENV: str(tmp_path)})
    (tmp_path / "ca.crt").write_text("x")
    (tmp_path / "user.crt").write_text("x")
    with pytest.raises(ValueError, match="mutual TLS needs both"):
        kafka.client_security({kafka.TLS_DIR_ENV: str(tmp_path)})
    with pytest.raises(ValueError, match=kafka.SASL_PASSWORD_FILE_ENV):
        kafka.client_security({kafka.SASL_USERNAME_ENV: "temper"})
    password = tmp_path / "password"
    password.write_text("s3cret\n")
    env = {kafka.SASL_USERNAME_ENV: "temper", kafka.SASL_PASSWORD_FILE_ENV: str(password)}
    with pytest.raises(ValueError, match=f"{kafka.SASL_MECHANISM_ENV}: 'GSSAPI' is not one of"):
        kafka.client_security({**env, kafka.SASL_MECHANISM_ENV: "GSSAPI"})
    assert kafka.client_security(env) == {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-512",
                                          "sasl_plain_username": "temper", "sasl_plain_password": "s3cret"}
    (tmp_path / "user.crt").unlink()
    both = kafka.client_security({**env, kafka.TLS_DIR_ENV: str(tmp_path)})
    assert both["security_protocol"] == "SASL_SSL" and both["ssl_cafile"] == str(tmp_path / "ca.crt")
    assert "ssl_certfile" not in both


def test_a_service_with_an_unusable_kafka_setting_stops_at_start_naming_it(tmp_path):
    env = {**os.environ, kafka.TLS_DIR_ENV: str(tmp_path / "missing")}
    out = subprocess.run([sys.executable, "-m", "temper.monitor", "--port", "0", "--data-dir", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"temper-monitor: {kafka.TLS_DIR_ENV}: {tmp_path / 'missing'} has no ca.crt" in out.stderr
