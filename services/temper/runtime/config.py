"""Typed service configuration: one way for every service.

Sources, highest priority first: command-line flags (``--kafka-bootstrap 127.0.0.1:9092``),
environment variables (``TEMPER_<SERVICE>_<FIELD>``), the ``[<service>]`` table of a TOML file
given with ``--config FILE``, then the defaults declared on the class.
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic_settings import BaseSettings, CliSettingsSource, InitSettingsSource, SettingsConfigDict

T = TypeVar("T", bound="ServiceConfig")


class ServiceConfig(BaseSettings):
    """Settings every service shares. Subclass per service and set ``section``."""

    model_config = SettingsConfigDict(extra="forbid", cli_kebab_case=True, cli_implicit_flags=True)
    section: ClassVar[str] = "service"
    _toml_values: ClassVar[dict[str, Any]] = {}

    host: str = "127.0.0.1"
    port: int = 0  # 0: the OS picks a free port (the launcher passes explicit ones)
    metrics_port: int = 0  # Prometheus endpoint; 0: the OS picks one, -1: disabled
    kafka_bootstrap: str = "127.0.0.1:9092"
    trace_file: str = ""  # append finished spans as JSON lines here ("" = no file export)
    otlp_endpoint: str = ""  # OTLP/gRPC collector address ("" = no OTLP export)
    log_level: str = "INFO"
    data_dir: str = ".temper/data"
    grace_seconds: float = 5.0  # SIGTERM: how long in-flight calls may take to finish
    max_workers: int = 16  # gRPC handler threads

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        return (init_settings, env_settings, InitSettingsSource(settings_cls, dict(cls._toml_values)))


def load_config(cls: type[T], argv: list[str] | None = None) -> T:
    """Build ``cls`` from ``--config FILE`` (its ``[cls.section]`` table), env and flags."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path)
    known, rest = pre.parse_known_args(argv or [])
    table: dict[str, Any] = {}
    if known.config is not None:
        with open(known.config, "rb") as f:
            table = tomllib.load(f).get(cls.section, {})
    env_prefix = f"TEMPER_{cls.section.upper()}_"
    bound = type(cls.__name__, (cls,), {
        "_toml_values": table,
        "model_config": {**cls.model_config, "env_prefix": env_prefix},
    })
    cli = CliSettingsSource(bound, cli_parse_args=rest, cli_kebab_case=True, cli_implicit_flags=True,
                            cli_prog_name=f"temper-{cls.section}")
    values = bound(_cli_settings_source=cli(args=rest))
    return cls.model_validate(values.model_dump())
