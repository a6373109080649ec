"""mTLS between services (``[auth] tls = true``): a private CA, one certificate per service, client certs required.

The embedded launcher (``temper up``) makes a fresh CA and signs one certificate per service plus one for
the launcher and the ``temper`` CLI (``client``), each in ``<home>/tls/<name>/`` as ``ca.crt``, ``tls.crt``
and ``tls.key`` (files 0600, folders 0700): the file names of a Kubernetes TLS Secret, so the same code
reads a Secret mounted in a pod. The CA's private key is never written: once ``up`` has signed the
certificates nobody (not even a later ``temper`` process) can mint another one; the next ``up`` makes a
new CA. A service is handed only the *path* of its folder, in ``TEMPER_TLS_DIR``.

A service started with ``TEMPER_TLS_DIR`` serves gRPC over TLS only (``server_credentials``) and requires
a client certificate signed by that CA (``require_client_auth``): a caller without one, or with one from
another CA, fails the TLS handshake and never reaches a servicer: gRPC reports that to the caller as
UNAVAILABLE (there is no status to send before a connection exists). Health checks need a certificate
too; the launcher and the supervisor have the ``client`` one. Every client channel
(``temper.client.transport.channel``, ``check_health``) presents the certificate of its own process.

Every certificate is for ``localhost``, ``127.0.0.1`` and its service's name (a server's name is
checked by its clients: the embedded mode dials ``127.0.0.1:<port>``), is valid for both server and
client authentication, and lasts ``DAYS`` days. Token auth (``[auth] mode = "token"``) works on top:
TLS says which deployment a caller belongs to, the token is then no longer plaintext on the wire.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from temper.client.transport import TLS_FILES, tls_files

DAYS = 30
CLIENT = "client"  # the identity of the launcher, its supervisor and the temper CLI


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Temper"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write_private(path: Path, data: bytes) -> None:
    """``data`` to ``path``, created 0600 (never readable by others, not even for a moment)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def make_ca(common_name: str = "Temper embedded CA") -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def issue(ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey,
          name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate for ``name`` (CN and a DNS name), ``localhost`` and ``127.0.0.1``, signed by ``ca``,
    usable as a server and as a client certificate."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    sans = [x509.DNSName(name), x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert, key


def write_identity(folder: Path, ca: x509.Certificate, cert: x509.Certificate,
                   key: ec.EllipticCurvePrivateKey) -> Path:
    """``ca.crt``, ``tls.crt``, ``tls.key`` in ``folder`` (0700; files 0600); returns the folder."""
    _private_dir(folder)
    for file_name, data in zip(TLS_FILES, (_pem(ca), _pem(cert), _key_pem(key)), strict=True):
        _write_private(folder / file_name, data)
    return folder


def write_certificates(home: Path, names: list[str] | tuple[str, ...]) -> Path:
    """A fresh CA and one identity per name in ``names`` and for ``CLIENT``, under ``<home>/tls``; returns that
    folder (each identity is ``<home>/tls/<name>``). The CA's key is dropped (module docstring)."""
    root = _private_dir(home / "tls")
    ca, ca_key = make_ca()
    for name in dict.fromkeys([*names, CLIENT]):
        write_identity(root / name, ca, *issue(ca, ca_key, name))
    return root


def server_credentials(tls_dir: str | Path | None = None) -> grpc.ServerCredentials | None:
    """TLS credentials of this process's gRPC server from ``tls_dir`` (default ``$TEMPER_TLS_DIR``): its own
    certificate, client certificates required and checked against the CA. None: plaintext."""
    files = tls_files(tls_dir)
    if files is None:
        return None
    ca, chain, key = files
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=ca, require_client_auth=True)


def tls_dir_of(tls_root: str, name: str) -> str:
    """The identity folder of ``name`` under the launcher's ``<home>/tls`` ("" when TLS is off)."""
    return str(Path(tls_root) / name) if tls_root else ""

