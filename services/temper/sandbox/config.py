"""Configuration of the sandbox service (the ``[sandbox]`` table), and building its parts from it.

Languages come from ``languages.toml`` beside this file; ``[sandbox.languages.<name>]`` tables in
the service's config add languages or replace presets, so a new language is a config entry.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from temper.runtime.config import ServiceConfig
from temper.sandbox.core import Executor, Language, Limits, Policy, load_languages
from temper.sandbox.runsc import RunscBackend, RunscSettings, SandboxPool

LANGUAGES_FILE = Path(__file__).with_name("languages.toml")


class LimitsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    wall_seconds: float
    cpu_seconds: float
    memory_mb: int
    max_processes: int
    max_output_bytes: int

    def limits(self) -> Limits:
        return Limits(**self.model_dump())


class LanguageConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source_file: str
    run: list[str]
    compile: list[str] = []
    test_harness: list[str] = []
    fork_server: list[str] = []
    harness_runs: bool = False
    extensions: list[str] = []
    env: dict[str, str] = {}
    aliases: list[str] = []


class SandboxConfig(ServiceConfig):
    section = "sandbox"

    replicas: int = Field(1, ge=1, description="how many sandbox services the local launcher (`temper up`) starts, "
                                               "each on its own port: reward's calls go round robin over all "
                                               "(Kubernetes: the Deployment's replicas behind a headless Service)")
    max_concurrency: int = Field(0, description="executions at once; 0 = the number of CPU cores")
    max_queue: int = Field(8, description="executions waiting for a slot; beyond: RESOURCE_EXHAUSTED")
    pool_size: int = Field(-1, description="sandboxes booted ahead; -1 = max_concurrency")
    default_limits: LimitsConfig = Field(
        LimitsConfig(wall_seconds=10, cpu_seconds=10, memory_mb=512, max_processes=64, max_output_bytes=1 << 20),
        description="limits of a request that sets none (a table naming some keeps the others)")
    # stdout and stderr of one run, at their maximum, must fit one gRPC message (64 MiB)
    max_limits: LimitsConfig = Field(
        LimitsConfig(wall_seconds=60, cpu_seconds=60, memory_mb=4096, max_processes=512, max_output_bytes=16 << 20),
        description="the most a request may ask for; beyond: INVALID_ARGUMENT naming the limit")
    compile_limits: LimitsConfig = Field(
        LimitsConfig(wall_seconds=60, cpu_seconds=60, memory_mb=2048, max_processes=64, max_output_bytes=1 << 20),
        description="limits of the compile step of compiled languages")
    max_source_bytes: int = Field(1 << 20, description="largest source file of a request")
    max_stdin_bytes: int = Field(16 << 20, description="largest stdin of a run or test")
    max_files: int = Field(64, description="most files in one request")
    max_tests: int = Field(1000, description="most test cases in one RunTests request")
    max_script_bytes: int = Field(1 << 20, description="largest assertion script of a test")
    languages: dict[str, LanguageConfig] = Field({}, description="added to (or replacing) the presets of "
                                                                 "languages.toml")
    warm_language: str = Field("python3", description="pooled sandboxes hold this language's harness started ahead "
                                                      '("" = none)')
    execution_mode: Literal["isolated", "batch"] = Field(
        "isolated", description='"isolated": a fresh gVisor sandbox per program (per Execute/RunTests call, per '
                                'program of a RunTestsBatch); "batch": a fresh sandbox per call, shared by the '
                                "programs of a RunTestsBatch one after the other, each as its own uid with a private "
                                "workdir and IPC namespace, Python runs forked from the warm language's fork_server "
                                "(see the README's sandbox section)")
    batch_uid_base: int = Field(10000, ge=1000, description="batch mode: program i of a group runs as this uid + i")
    max_batch_programs: int = Field(64, ge=1, le=1024, description="most programs in one RunTestsBatch call")

    runsc: str = Field("runsc", description="the gVisor runsc binary (name on PATH or path)")
    runsc_platform: str = Field("ptrace", description="kvm hangs here (nested virtualisation); systrap is newer than "
                                                      "Debian's runsc")
    runsc_flags: list[str] = Field([], description="extra runsc flags, passed as they are")
    python: str = Field("", description='the sandbox\'s Python for the agent ("" = /usr/bin/python3 or '
                                        "/usr/local/bin/python3)")
    binds: list[str] = Field(["/usr"], description="host directories visible read-only inside every sandbox")
    workdir_mb: int = Field(256, description="size of each of the /work and /tmp tmpfs of a sandbox")
    sandbox_cpus: float = Field(1.0, description="CPU quota of one sandbox, in cores")
    memory_slack_mb: int = Field(32, description="headroom over a run's memory limit for the sandbox's own growth")
    boot_timeout_seconds: float = Field(30.0, description="how long a sandbox may take to boot")
    sandbox_uid: int = Field(65534, description="the uid code runs as inside the sandbox")

    publish_traces: bool = Field(True, description="ExecutionTrace per call on the sandbox-traces topic")
    trace_max_bytes: int = Field(16 << 10, description="byte fields of a trace are truncated to this")

    @field_validator("default_limits", "max_limits", "compile_limits", mode="before")
    @classmethod
    def _partial_limits(cls, value, info):
        """A table naming some limits keeps the others at their defaults."""
        if isinstance(value, dict):
            return {**cls.model_fields[info.field_name].default.model_dump(), **value}
        return value

    def concurrency(self) -> int:
        return self.max_concurrency or os.cpu_count() or 1

    def language_presets(self) -> dict[str, Language]:
        tables = tomllib.loads(LANGUAGES_FILE.read_text())
        tables.update({name: lang.model_dump() for name, lang in self.languages.items()})
        return load_languages(tables)

    def policy(self) -> Policy:
        return Policy(defaults=self.default_limits.limits(), maxima=self.max_limits.limits(),
                      compile_limits=self.compile_limits.limits(), max_source_bytes=self.max_source_bytes,
                      max_stdin_bytes=self.max_stdin_bytes, max_files=self.max_files, max_tests=self.max_tests,
                      max_script_bytes=self.max_script_bytes)

    def runsc_settings(self) -> RunscSettings:
        warm = self.language_presets().get(self.warm_language) if self.warm_language else None
        if self.warm_language and (warm is None or not warm.test_harness):
            raise ValueError(f"warm_language {self.warm_language!r} is not a language with a test_harness")
        batch = self.execution_mode == "batch"
        return RunscSettings(
            batch=batch, batch_uid_base=self.batch_uid_base, max_batch_programs=self.max_batch_programs,
            fork_server=warm.fork_server if batch and warm else (),
            warm_command=warm.test_harness if warm else (), warm_env=dict(warm.env) if warm else {},
            runsc=self.runsc, platform=self.runsc_platform, extra_flags=tuple(self.runsc_flags), python=self.python,
            binds=tuple(self.binds), state_dir=self.data_dir, workdir_mb=self.workdir_mb, cpus=self.sandbox_cpus,
            memory_slack_mb=self.memory_slack_mb,
            boot_memory_mb=max(self.max_limits.memory_mb, self.compile_limits.memory_mb) + 512,
            boot_timeout_seconds=self.boot_timeout_seconds, uid=self.sandbox_uid)


def build_executor(config: SandboxConfig, pool_size: int | None = None) -> tuple[Executor, SandboxPool]:
    """The executor over a warm pool of gVisor sandboxes. Raises RuntimeError if runsc cannot run here."""
    concurrency = config.concurrency()
    requested = config.pool_size if pool_size is None else pool_size
    pool = SandboxPool(RunscBackend(config.runsc_settings()), concurrency if requested < 0 else requested)
    executor = Executor(pool.acquire, pool.release, config.language_presets(), config.policy(), concurrency,
                        config.max_queue, batch=config.execution_mode == "batch",
                        max_batch_programs=config.max_batch_programs)
    return executor, pool
