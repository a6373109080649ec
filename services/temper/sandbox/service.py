"""The sandbox service: gRPC Execute/RunTests in gVisor sandboxes (a warm pool); traces to Kafka."""

from __future__ import annotations

from contextlib import ExitStack

from prometheus_client import Gauge

from temper.client.transport import AUTH_TOKEN_FILE_ENV, TLS_DIR_ENV
from temper.runtime import kafka
from temper.runtime.auth import binds_exposing_secrets
from temper.runtime.logs import get_logger
from temper.runtime.service import Service, StartupError
from temper.sandbox.config import SandboxConfig, build_executor
from temper.sandbox.servicer import SandboxServicer
from temper.v1 import sandbox_pb2, sandbox_pb2_grpc

_log = get_logger(component="sandbox")


class SandboxService(Service[SandboxConfig]):
    name = "sandbox"
    config_class = SandboxConfig

    def __init__(self, config: SandboxConfig):
        # every execution the sandbox admits (running or waiting) is a call in flight: its own queue
        # (max_queue) refuses the next ones, with the sandbox's reason
        config.max_concurrent_rpcs = max(config.max_concurrent_rpcs, config.concurrency() + config.max_queue + 4)
        super().__init__(config)
        self.producer: kafka.ProtoProducer | None = None

    def open(self, stack: ExitStack) -> None:
        exposing = binds_exposing_secrets(self.config.binds)
        if exposing:
            raise StartupError(f"sandbox.binds: {', '.join(exposing)} holds the services' auth token file "
                               f"(${AUTH_TOKEN_FILE_ENV}) or TLS keys (${TLS_DIR_ENV}); sandboxed programs must not see "
                               "them: bind another folder")
        try:
            self.executor, self.pool = build_executor(self.config)
        except (RuntimeError, ValueError) as e:  # runsc missing, not root, no cgroups, bad warm_language
            raise StartupError(str(e)) from e
        stack.callback(self.pool.close)
        executor, pool = self.executor, self.pool
        Gauge("temper_sandbox_pool_ready", "Booted sandboxes waiting for work").set_function(lambda: pool.ready)
        Gauge("temper_sandbox_running", "Executions running").set_function(lambda: executor.admission.running)
        Gauge("temper_sandbox_queued", "Executions waiting for a slot").set_function(lambda: executor.admission.waiting)
        if self.config.publish_traces:
            kafka.ensure_topics(self.config.kafka_bootstrap, (kafka.SANDBOX_TRACES,))
            self.producer = kafka.ProtoProducer(self.config.kafka_bootstrap, client_id="temper-sandbox")
            stack.callback(self.producer.close)
            stack.callback(self.producer.flush, 10)

    def _publish(self, trace: sandbox_pb2.ExecutionTrace) -> None:
        future = self.producer.send(kafka.SANDBOX_TRACES, trace.execution_id, trace)
        future.add_errback(lambda e: _log.error("trace not published", error=str(e), execution_id=trace.execution_id))

    def register(self, server) -> list[str]:
        servicer = SandboxServicer(self.executor, self._publish if self.producer else None, self.config.trace_max_bytes)
        sandbox_pb2_grpc.add_SandboxServiceServicer_to_server(servicer, server)
        return [sandbox_pb2.DESCRIPTOR.services_by_name["SandboxService"].full_name]

    def checks(self):
        return [lambda: not self.pool.last_boot_error]
