"""Entry point: python -m temper.sandbox — gRPC Execute/RunTests in gVisor sandboxes; traces to Kafka."""

from __future__ import annotations

import sys

from prometheus_client import Gauge

from temper.runtime import kafka
from temper.runtime.config import load_config
from temper.runtime.logs import get_logger
from temper.runtime.rpc import Service, serve
from temper.sandbox.config import SandboxConfig, build_executor
from temper.sandbox.servicer import SandboxServicer
from temper.v1 import sandbox_pb2, sandbox_pb2_grpc

_log = get_logger(component="sandbox")


def main(argv: list[str] | None = None) -> None:
    config = load_config(SandboxConfig, sys.argv[1:] if argv is None else argv)
    # the gRPC pool must hold every admitted call plus room to refuse the next ones at once
    config.max_workers = max(config.max_workers, config.concurrency() + config.max_queue + 4)
    try:
        executor, pool = build_executor(config)
    except (RuntimeError, ValueError) as e:  # runsc missing, not root, no cgroups, bad warm_language
        sys.exit(f"temper-sandbox: {e}")
    Gauge("temper_sandbox_pool_ready", "Booted sandboxes waiting for work").set_function(lambda: pool.ready)
    Gauge("temper_sandbox_running", "Executions running").set_function(lambda: executor.admission.running)
    Gauge("temper_sandbox_queued", "Executions waiting for a slot").set_function(lambda: executor.admission.waiting)
    state: dict = {}

    def publish(trace: sandbox_pb2.ExecutionTrace) -> None:
        if "producer" not in state:  # a call that raced the start-up: nothing to publish with yet
            return
        future = state["producer"].send(kafka.SANDBOX_TRACES, trace.execution_id, trace)
        future.add_errback(lambda e: _log.error("trace not published", error=str(e), execution_id=trace.execution_id))

    def on_start():
        if config.publish_traces:
            kafka.ensure_topics(config.kafka_bootstrap, (kafka.SANDBOX_TRACES,))
            state["producer"] = kafka.ProtoProducer(config.kafka_bootstrap, client_id="temper-sandbox")

    def on_stop():
        pool.close()
        if "producer" in state:
            state["producer"].flush(10)
            state["producer"].close()

    def register(server):
        servicer = SandboxServicer(executor, publish if config.publish_traces else None, config.trace_max_bytes)
        sandbox_pb2_grpc.add_SandboxServiceServicer_to_server(servicer, server)
        return [sandbox_pb2.DESCRIPTOR.services_by_name["SandboxService"].full_name]

    serve(config, Service("sandbox", register, on_start=on_start, on_stop=on_stop,
                          checks=[lambda: not pool.last_boot_error]))


if __name__ == "__main__":
    main()
