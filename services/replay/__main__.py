"""Entry point: python -m temper.replay — `scored` -> durable tables; gRPC Sample/Insert/Stats."""

from __future__ import annotations

import sys
from pathlib import Path

from temper.replay.servicer import ReplayServicer
from temper.replay.store import ReplayStore
from temper.runtime import kafka
from temper.runtime.config import ServiceConfig, load_config
from temper.runtime.rpc import Service, serve
from temper.v1 import common_pb2, replay_pb2, replay_pb2_grpc


class ReplayConfig(ServiceConfig):
    section = "replay"
    consumer_group: str = "temper-replay"
    tables: list[str] = ["default"]
    ingest_table: str = "default"  # where groups from the `scored` topic go
    max_batch: int = 4096
    max_timeout_ms: int = 600_000


def main(argv: list[str] | None = None) -> None:
    config = load_config(ReplayConfig, sys.argv[1:] if argv is None else argv)
    store = ReplayStore(Path(config.data_dir) / "replay.sqlite", config.tables)
    state: dict = {}

    def on_start():
        kafka.ensure_topics(config.kafka_bootstrap)
        state["consumer"] = kafka.ProtoConsumer(
            config.kafka_bootstrap, kafka.SCORED, config.consumer_group, common_pb2.RolloutGroup,
            lambda group: store.insert(config.ingest_table, [group])).start()

    def on_stop():
        state["consumer"].stop()
        store.close()

    def register(server):
        replay_pb2_grpc.add_ReplayServiceServicer_to_server(
            ReplayServicer(store, config.max_batch, config.max_timeout_ms), server)
        return [replay_pb2.DESCRIPTOR.services_by_name["ReplayService"].full_name]

    serve(config, Service("replay", register, on_start=on_start, on_stop=on_stop))


if __name__ == "__main__":
    main()
