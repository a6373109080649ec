"""Typed service configuration: one way for every service.

Sources, highest priority first: command-line flags (``--kafka-bootstrap 127.0.0.1:9092``),
environment variables (``TEMPER_<SERVICE>_<FIELD>``), the ``[<service>]`` table of a TOML file
given with ``--config FILE``, then the defaults declared on the class. ``--help`` lists every
field with its description and default.

Wiring metadata: a field can say what the local launcher (``temper.runtime.launcher``) fills
in, so the launcher hard-codes nothing per service:

* ``address_of("inference")``: the address of that service (a ``list[str]`` field gets a list);
* ``model_dir()``: the service loads the job's model; the launcher resolves the ``[model]``
  table to a folder (only for services that declare this);
* ``from_job("prompts_per_step")``: the value of that key of the job's ``[job]`` table;
* ``shared_dir("policy")``: one folder of the stack that every service declaring the same name gets
  (``<home>/data/shared/policy``): the learner writes the current policy there, inference replicas read it.

A service whose config has a ``replicas`` field is started that many times by the launcher: the
replicas are named ``<service>``, ``<service>-1``, ...; an ``address_of`` it gets every replica's address
(a ``str`` field as one ``ipv4:a:p,b:q`` target, which ``temper.client.transport`` balances round_robin).
"""

from __future__ import annotations

import argparse
import difflib
import tomllib
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat, load_pem_private_key
from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, CliSettingsSource, InitSettingsSource, SettingsConfigDict

T = TypeVar("T", bound="ServiceConfig")
_SPKI = (Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
WIRING = "temper_wiring"  # the json_schema_extra key of the launcher's metadata


class ServiceConfig(BaseSettings):
    """Settings every service shares. Subclass per service and set ``section``."""

    model_config = SettingsConfigDict(extra="forbid", cli_kebab_case=True, cli_implicit_flags=True)
    section: ClassVar[str] = "service"
    _toml_values: ClassVar[dict[str, Any]] = {}

    host: str = Field("127.0.0.1", description="interface the gRPC and metrics servers bind")
    port: int = Field(0, description="gRPC port; 0: the OS picks a free one (reported in the log and --port-file)")
    metrics_port: int = Field(0, description="Prometheus /metrics port; 0: the OS picks one, -1: disabled")
    port_file: str = Field("", description='once bound, write {"address", "metrics_port", "pid"} here as JSON '
                                           '(atomically; "" = log only)')
    kafka_bootstrap: str = Field("127.0.0.1:9092", description="Kafka bootstrap servers (host:port[,host:port])")
    trace_file: str = Field("", description='append finished spans as JSON lines here ("" = no file export)')
    trace_sample_ratio: float = Field(1.0, ge=0.0, le=1.0, description="share of traces recorded, 0 to 1: a trace "
                                      "this service starts is kept with this probability (by trace id); a span "
                                      "with a remote parent follows the parent, so a trace is kept or dropped "
                                      "whole")
    otlp_endpoint: str = Field("", description='OTLP/gRPC collector address ("" = no OTLP export); '
                                                'https://host:port means TLS')
    otlp_tls: bool = Field(False, description="TLS to the OTLP collector (verified against otlp_ca_file, else the "
                                              "system roots); on by itself when otlp_ca_file or otlp_cert_file is "
                                              "set or otlp_endpoint is https://...; off: plaintext")
    otlp_ca_file: str = Field("", description="PEM CA certificate(s) the OTLP collector's certificate must chain to "
                                              '(turns TLS on)')
    otlp_cert_file: str = Field("", description="PEM client certificate for a collector that requires mTLS "
                                                "(with otlp_key_file)")
    otlp_key_file: str = Field("", validate_default=True,
                               description="PEM private key of otlp_cert_file (both or neither)")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR")
    data_dir: str = Field(".temper/data", description="where the service keeps its files")
    grace_seconds: float = Field(5.0, description="on SIGTERM, how long in-flight calls may take to finish")
    max_concurrent_rpcs: int = Field(64, ge=1, description="calls served at once (health checks aside); the next "
                                     "one is refused RESOURCE_EXHAUSTED with retry advice (backpressure)")

    @field_validator("otlp_ca_file", "otlp_cert_file")
    @classmethod
    def _pem_certificates(cls, path: str) -> str:
        if path:
            certificates_in(_read(path))
        return path

    @field_validator("otlp_key_file")
    @classmethod
    def _client_key(cls, path: str, info: ValidationInfo) -> str:
        if "otlp_cert_file" not in info.data:  # the certificate is wrong: that error says so
            return path
        cert_file = info.data["otlp_cert_file"]
        if bool(path) != bool(cert_file):
            raise ValueError("otlp_cert_file and otlp_key_file go together: set both or neither")
        if path:
            pem = _read(path)
            try:  # the message never quotes the file: it holds a secret
                key = load_pem_private_key(pem, password=None)
            except (ValueError, TypeError):
                raise ValueError("not an unencrypted PEM private key") from None
            cert = certificates_in(_read(cert_file))[0]
            if cert.public_key().public_bytes(*_SPKI) != key.public_key().public_bytes(*_SPKI):
                raise ValueError(f"not the private key of otlp_cert_file {cert_file}")
        return path

    def otlp_uses_tls(self) -> bool:
        """Whether spans go to ``otlp_endpoint`` over TLS (the rule of ``otlp_tls``'s description)."""
        return bool(self.otlp_tls or self.otlp_ca_file or self.otlp_cert_file
                    or self.otlp_endpoint.startswith("https://"))

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        return (init_settings, env_settings, InitSettingsSource(settings_cls, dict(cls._toml_values)))


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the file: {e.strerror}") from None


def certificates_in(pem: bytes) -> list[x509.Certificate]:
    """The X.509 certificates of the PEM bytes ``pem``: at least one, else a ValueError."""
    try:
        return x509.load_pem_x509_certificates(pem)
    except ValueError:
        raise ValueError("not a PEM certificate file") from None


def address_of(service: str, default, description: str):
    """A field holding the gRPC address(es) of ``service``; the launcher passes the address it got."""
    return Field(default, description=description, json_schema_extra={WIRING: {"address_of": service}})


def model_dir(default: str, description: str):
    """The folder of the model this service loads; the launcher resolves the job's ``[model]`` table into it."""
    return Field(default, description=description, json_schema_extra={WIRING: {"model": True}})


def from_job(key: str, default, description: str):
    """A field the launcher sets from ``[job].<key>`` of the job config, when the job sets it."""
    return Field(default, description=description, json_schema_extra={WIRING: {"from_job": key}})


def shared_dir(name: str, default: str, description: str):
    """A folder the launcher gives to every service that declares ``shared_dir(name)``: the same one for all."""
    return Field(default, description=description, json_schema_extra={WIRING: {"shared_dir": name}})


def replica_shard(description: str):
    """``"i/n"``: which of the service's ``n`` replicas this process is (the launcher passes it to each replica
    when ``n`` > 1); "" = the only one."""
    return Field("", pattern=r"^(\d+/\d+)?$", description=description, json_schema_extra={WIRING: {"shard": True}})


def wiring(cls: type[ServiceConfig]) -> dict[str, dict]:
    """``{field name: its wiring metadata}`` of the fields of ``cls`` that declare some."""
    out = {}
    for name, info in cls.model_fields.items():
        extra = info.json_schema_extra
        if isinstance(extra, dict) and WIRING in extra:
            out[name] = dict(extra[WIRING])
    return out


def _split(cls: type[ServiceConfig], argv: list[str] | None) -> tuple[dict[str, Any], list[str]]:
    """(the ``[cls.section]`` table of ``--config FILE``, the other arguments)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path)
    known, rest = pre.parse_known_args(argv or [])
    table: dict[str, Any] = {}
    if known.config is not None:
        with open(known.config, "rb") as f:
            table = tomllib.load(f).get(cls.section, {})
    return table, rest


def env_name(cls: type[ServiceConfig], field: str) -> str:
    """The environment variable of ``field``: ``TEMPER_<SECTION>_<FIELD>``."""
    return section_env_name(cls.section, field)


def section_env_name(section: str, field: str) -> str:
    """The environment variable of ``field`` of the service whose config section is ``section`` (the same
    rule as ``env_name``, for callers that hold a job file's tables rather than the config class)."""
    return f"TEMPER_{section.upper()}_{field.upper()}"


def load_config(cls: type[T], argv: list[str] | None = None) -> T:
    """Build ``cls`` from ``--config FILE`` (its ``[cls.section]`` table), env and flags."""
    table, rest = _split(cls, argv)
    env_prefix = f"TEMPER_{cls.section.upper()}_"
    bound = type(cls.__name__, (cls,), {
        "_toml_values": table,
        "model_config": {**cls.model_config, "env_prefix": env_prefix},
    })
    cli = CliSettingsSource(bound, cli_parse_args=rest, cli_kebab_case=True, cli_implicit_flags=True,
                            cli_prog_name=f"temper-{cls.section}")
    values = bound(_cli_settings_source=cli(args=rest))
    return cls.model_validate(values.model_dump())


def field_sources(cls: type[ServiceConfig], argv: list[str] | None = None,
                  environ: dict[str, str] | None = None) -> dict[str, str]:
    """Where ``load_config(cls, argv)`` takes each field's value from, by the same priority:
    ``"flag --name"``, ``"env TEMPER_<SECTION>_<FIELD>"``, ``"file"`` (the ``[section]`` table) or ``"default"``."""
    import os

    table, rest = _split(cls, argv)
    flags = {a.split("=", 1)[0] for a in rest if a.startswith("--")}
    env = {k.upper() for k in (os.environ if environ is None else environ)}
    out = {}
    for name in cls.model_fields:
        flag = "--" + name.replace("_", "-")
        if flag in flags:
            out[name] = f"flag {flag}"
        elif env_name(cls, name) in env:
            out[name] = f"env {env_name(cls, name)}"
        elif name in table:
            out[name] = "file"
        else:
            out[name] = "default"
    return out


def _known_keys(cls: type, path) -> list[str]:
    """The keys of the (nested) model table at ``path`` below ``cls``, following models, dicts and lists
    (``tables.default`` -> the fields of the table model); [] where the path leads to no model."""
    import typing

    from pydantic import BaseModel

    def model_in(tp):
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            return tp
        for arg in typing.get_args(tp):
            if (m := model_in(arg)) is not None:
                return m
        return None

    node = cls
    for part in path:
        if isinstance(node, type) and issubclass(node, BaseModel):
            if str(part) not in node.model_fields:
                return []
            node = node.model_fields[str(part)].annotation
        else:  # a dict value or list item: the model it holds
            args = typing.get_args(node)
            node = args[-1] if args else None
        if node is None:
            return []
    model = model_in(node)
    return sorted(model.model_fields) if model is not None else []


def describe_errors(cls: type[ServiceConfig], error: ValidationError, argv: list[str] | None = None) -> list[str]:
    """One line per error of ``error``: ``[section] key: what is wrong (got VALUE; from SOURCE)``, naming the
    allowed keys for an unknown one; the source is the environment variable or flag when one set it."""
    sources = field_sources(cls, argv)
    lines = []
    for err in error.errors():
        loc = ".".join(str(part) for part in err["loc"])
        top = str(err["loc"][0]) if err["loc"] else ""
        if err["type"] == "extra_forbidden":
            known = _known_keys(cls, err["loc"][:-1])
            close = difflib.get_close_matches(str(err["loc"][-1]), known, n=1)
            what = "unknown key" + (f" (did you mean {close[0]}?)" if close else "") \
                + (f"; known: {', '.join(known)}" if known else "")
        else:
            what = err["msg"].removeprefix("Value error, ")
            if "input" in err and not isinstance(err["input"], dict):
                what += f" (got {err['input']!r})"
        source = sources.get(top, "")
        if source.startswith(("env", "flag")):
            what += f" [from {source}]"
        lines.append(f"[{cls.section}] {loc or '(table)'}: {what}")
    return lines


M = TypeVar("M")


def job_table(model: type[M], cfg: dict, name: str, source: str | Path = "config") -> M:
    """The ``[name]`` table of a whole job config validated by the pydantic ``model`` (absent: its defaults);
    a mistake is a ValueError naming the file and ``name.KEY``."""
    try:
        return model.model_validate(cfg.get(name, {}))
    except ValidationError as e:
        problems = "; ".join(f"{name}.{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ValueError(f"{source}: [{name}] {problems}") from None
