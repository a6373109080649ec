"""The replay service: `scored` -> durable tables; gRPC Insert/Sample/UpdatePriorities/
Stats/Checkpoint/Restore.

Tables are configured under ``[replay.tables.NAME]`` (see ``tables.TableConfig``); groups from
the `scored` topic go into every table named in ``ingest_tables``. The consumer commits a
message's offset only after ``ReplayStore.insert`` returned, i.e. after the group is durable;
while a table's rate limiter holds inserts back, the consumer waits (``ingest_block_ms`` per
try, then the message is retried), so Kafka keeps the backlog.

Shards (``[replay] replicas = N``; each process ``--shard i/N``): a shard owns the partitions p of `scored`
with p % N == i (assigned, not balanced, so a group is stored by one shard only); readers sample the shards
as one table with ``temper.client.shards.ShardedReplay``.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from temper.replay import servicer as replay_servicer
from temper.replay.config import ReplayConfig
from temper.replay.store import ReplayStore
from temper.runtime import kafka
from temper.runtime.service import Service, StartupError
from temper.runtime.storage import StorageError, mirror_from_url
from temper.v1 import common_pb2


class ReplayService(Service[ReplayConfig]):
    name = "replay"
    config_class = ReplayConfig

    def open(self, stack: ExitStack) -> None:
        config = self.config
        try:
            mirror = mirror_from_url(config.snapshot_url)
        except StorageError as e:
            raise StartupError(f"snapshot_url: {e}") from e
        self.store = ReplayStore(Path(config.data_dir) / "replay.sqlite", config.tables, config.checkpoint_dir or None,
                                 fsync=config.fsync, mirror=mirror)
        stack.callback(self.store.close)
        self.consumer = None
        if config.ingest_tables:
            kafka.ensure_topics(config.kafka_bootstrap)
            shard = tuple(int(x) for x in config.shard.split("/")) if config.shard else None
            try:
                self.consumer = kafka.ProtoConsumer(config.kafka_bootstrap, kafka.SCORED, config.consumer_group,
                                                    common_pb2.RolloutGroup, self._ingest, shard=shard).start()
            except ValueError as e:  # a shard count that does not divide the partitions
                raise StartupError(str(e)) from e
            stack.callback(self.consumer.stop)

    def _ingest(self, group: common_pb2.RolloutGroup) -> None:
        pending = self.store.prepare([group])
        for table in self.config.ingest_tables:
            self.store.insert(table, pending, timeout=self.config.ingest_block_ms / 1000)

    def register(self, server) -> list[str]:
        c = self.config
        return [replay_servicer.register(replay_servicer.ReplayServicer(
            self.store, c.max_batch, c.max_timeout_ms, c.insert_timeout_ms), server)]

    def checks(self):
        return [lambda: self.consumer is None or self.consumer.alive]
