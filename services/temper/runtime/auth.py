"""Authentication of gRPC calls: one shared bearer token for every service (``[auth] mode = "token"``).

The server bootstrap (``temper.runtime.service``) installs ``TokenAuthInterceptor`` when the
process has ``TEMPER_AUTH_TOKEN_FILE`` set; clients (``temper.client.transport.channel``) send the
same file's token. A call without ``authorization: Bearer ...`` metadata is refused with
UNAUTHENTICATED, one with another token with PERMISSION_DENIED (compared in constant time).
``grpc.health.v1.Health`` stays open, so probes (the launcher, Kubernetes) need no secret; server
reflection and every Temper method need the token. The Prometheus endpoint is not gRPC and stays
open (it serves counters only).

The embedded launcher makes the token (``write_token``: 32 random bytes, ``<home>/auth/token``,
mode 0600 in a 0700 folder) and hands its *path* to the services in their environment: never the
token on a command line, in the state file or in a log. The sandbox gives sandboxed programs an
environment of its own (PATH, HOME, TMPDIR, the language's variables) and a root without the
home folder, so a program under test sees neither the variable nor the file (a ``[sandbox] binds``
entry that would show it the file stops the sandbox at start-up). In Kubernetes the
same variable names a file mounted from a Secret.

The token travels in plaintext metadata: fine on loopback (the embedded mode), not across an
untrusted network without TLS in front.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path
from typing import Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field

from temper.client.transport import AUTH_TOKEN_FILE_ENV, TLS_DIR_ENV, auth_token
from temper.runtime.config import job_table
from temper.runtime.rpc import rewrap

OPEN_METHODS = ("/grpc.health.v1.Health/",)  # prefixes callable without a token


class AuthConfig(BaseModel):
    """The ``[auth]`` table of a job config."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["none", "token"] = Field("none", description='"token": every service requires the shared token '
                                                               "that the launcher generates under <home>/auth")
    tls: bool = Field(False, description="mTLS between every service, the launcher and the CLI: the launcher makes a CA "
                                         "and one certificate per service under <home>/tls; every gRPC port then "
                                         "requires a client certificate from that CA (temper.runtime.tls)")

    @classmethod
    def from_config(cls, cfg: dict, source: str | Path = "config") -> AuthConfig:
        return job_table(cls, cfg, "auth", source)


def write_token(home: Path) -> Path:
    """A fresh random token in ``<home>/auth/token`` (0600, folder 0700), created with those modes (never
    readable by others, not even for a moment); returns the file's path."""
    folder = home / "auth"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    path = folder / "token"
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32))
    return path


def server_token() -> str:
    """The token this process's server requires ("" when ``TEMPER_AUTH_TOKEN_FILE`` is not set: no auth)."""
    token = auth_token()
    if os.environ.get(AUTH_TOKEN_FILE_ENV) and not token:
        raise RuntimeError(f"{AUTH_TOKEN_FILE_ENV} names an empty file")
    return token


def binds_exposing_secrets(binds: list[str] | tuple[str, ...]) -> list[str]:
    """The host folders among ``binds`` (the sandbox's read-only binds) that hold this process's token file or
    its TLS key folder (``$TEMPER_TLS_DIR``), or sit inside that folder."""
    secrets_ = [Path(p).resolve() for p in (os.environ.get(AUTH_TOKEN_FILE_ENV, ""), os.environ.get(TLS_DIR_ENV, ""))
                if p]
    return [b for b in binds
            if any(s.is_relative_to(Path(b).resolve()) or Path(b).resolve().is_relative_to(s) for s in secrets_)]


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the shared token (module docstring); health checks pass."""

    def __init__(self, token: str):
        self._token = token.encode()

    def __repr__(self) -> str:  # never the token
        return "TokenAuthInterceptor(***)"

    def _refusal(self, metadata) -> tuple[grpc.StatusCode, str] | None:
        values = [v for k, v in metadata or () if k == "authorization"]
        if not values:
            return grpc.StatusCode.UNAUTHENTICATED, "this service requires authorization: Bearer <token> metadata " \
                                                    f"(the SDK sends the token in ${AUTH_TOKEN_FILE_ENV})"
        scheme, _, presented = str(values[0]).partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), self._token):
            return grpc.StatusCode.PERMISSION_DENIED, "authorization: the token is not this deployment's"
        return None

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHODS):
            return handler
        refusal = self._refusal(handler_call_details.invocation_metadata)
        if refusal is None:
            return handler
        code, message = refusal

        def refuse(request_or_iterator, context):
            context.abort(code, message)

        return rewrap(handler, lambda _behavior, _streams: refuse)
