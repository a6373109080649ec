"""Entry point: python -m temper.replay — `scored` -> durable tables; gRPC Insert/Sample/UpdatePriorities/
Stats/Checkpoint/Restore.

Tables are configured under ``[replay.tables.NAME]`` (see ``tables.TableConfig``); groups from
the `scored` topic go into every table named in ``ingest_tables``. The consumer commits a
message's offset only after ``ReplayStore.insert`` returned, i.e. after the group is durable;
while a table's rate limiter holds inserts back, the consumer waits (``ingest_block_ms`` per
try, then the message is retried), so Kafka keeps the backlog.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import Field, model_validator

from temper.replay import servicer as replay_servicer
from temper.replay.store import ReplayStore
from temper.replay.tables import TableConfig
from temper.runtime import kafka
from temper.runtime.config import ServiceConfig, load_config
from temper.runtime.rpc import Service, serve
from temper.v1 import common_pb2


class ReplayConfig(ServiceConfig):
    section = "replay"
    consumer_group: str = "temper-replay"
    # the default: one FIFO table whose groups are each sampled once (what the on-policy learner wants)
    tables: dict[str, TableConfig] = Field(default_factory=lambda: {"default": TableConfig()})
    ingest_tables: list[str] = ["default"]  # where groups from the `scored` topic go ([] = no Kafka ingest)
    max_batch: int = 4096  # groups per Sample
    max_timeout_ms: int = 600_000  # longest Sample wait a request may ask for
    insert_timeout_ms: int = 60_000  # how long an Insert without a gRPC deadline may wait for the rate limiter
    ingest_block_ms: int = 10_000  # how long one consumed group waits for the rate limiter before a retry
    checkpoint_dir: str = ""  # "" = <data_dir>/checkpoints
    # true: an acknowledged group survives an OS crash or power loss (fsync before every answer);
    # false: it survives a crash of this process (kill -9) only, for two fsyncs less per write
    fsync: bool = True

    @model_validator(mode="after")
    def _known_tables(self) -> ReplayConfig:
        unknown = [t for t in self.ingest_tables if t not in self.tables]
        if unknown:
            raise ValueError(f"ingest_tables {unknown} are not configured tables {sorted(self.tables)}")
        return self


def main(argv: list[str] | None = None) -> None:
    config = load_config(ReplayConfig, sys.argv[1:] if argv is None else argv)
    store = ReplayStore(Path(config.data_dir) / "replay.sqlite", config.tables, config.checkpoint_dir or None,
                        fsync=config.fsync)
    state: dict = {}

    def ingest(group: common_pb2.RolloutGroup) -> None:
        pending = store.prepare([group])
        for table in config.ingest_tables:
            store.insert(table, pending, timeout=config.ingest_block_ms / 1000)

    def on_start():
        if config.ingest_tables:
            kafka.ensure_topics(config.kafka_bootstrap)
            state["consumer"] = kafka.ProtoConsumer(config.kafka_bootstrap, kafka.SCORED, config.consumer_group,
                                                    common_pb2.RolloutGroup, ingest).start()

    def on_stop():
        if "consumer" in state:
            state["consumer"].stop()
        store.close()

    def register(server):
        return [replay_servicer.register(replay_servicer.ReplayServicer(
            store, config.max_batch, config.max_timeout_ms, config.insert_timeout_ms), server)]

    serve(config, Service("replay", register, on_start=on_start, on_stop=on_stop,
                          checks=[lambda: "consumer" not in state or state["consumer"].alive]))


if __name__ == "__main__":
    main()
