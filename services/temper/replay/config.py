"""Configuration of the replay service (the ``[replay]`` table; tables under ``[replay.tables.NAME]``,
see ``tables.TableConfig``)."""

from __future__ import annotations

from pydantic import Field, model_validator

from temper.replay.tables import TableConfig
from temper.runtime.config import ServiceConfig, replica_shard


class ReplayConfig(ServiceConfig):
    section = "replay"

    consumer_group: str = Field("temper-replay", description="Kafka consumer group of the `scored` stream")
    replicas: int = Field(1, ge=1, le=64, description="replay shards the local launcher (`temper up`) starts: each "
                          "owns the partitions p of `scored` with p % replicas == its index; the learner samples "
                          "across all (temper.client.shards)")
    shard: str = replica_shard("\"i/n\": this process is shard i of n and ingests only the partitions p of `scored` "
                               "with p % n == i (their number must divide by n); \"\" = every partition, through "
                               "the consumer group's balancing")
    # the default: one FIFO table whose groups are each sampled once (what the on-policy learner wants)
    tables: dict[str, TableConfig] = Field(default_factory=lambda: {"default": TableConfig()},
                                           description="[replay.tables.NAME]: sampler, remover, size, rate limiter")
    ingest_tables: list[str] = Field(["default"], description="where groups from the `scored` topic go "
                                                              "([] = no Kafka ingest)")
    max_batch: int = Field(4096, description="groups per Sample")
    max_timeout_ms: int = Field(600_000, description="longest Sample wait a request may ask for")
    insert_timeout_ms: int = Field(60_000, description="how long an Insert without a gRPC deadline may wait for the "
                                                       "rate limiter")
    ingest_block_ms: int = Field(10_000, description="how long one consumed group waits for the rate limiter before "
                                                     "a retry")
    checkpoint_dir: str = Field("", description='"" = <data_dir>/checkpoints')
    snapshot_url: str = Field("", description="object storage (s3://bucket/prefix or a path) every snapshot (gRPC "
                                              "Checkpoint) is uploaded to; Restore of an id not in checkpoint_dir "
                                              "fetches it from there; \"\" = checkpoint_dir only")
    fsync: bool = Field(True, description="true: an acknowledged group survives an OS crash or power loss (fsync "
                                          "before every answer); false: it survives a crash of this process "
                                          "(kill -9) only, for two fsyncs less per write")

    @model_validator(mode="after")
    def _known_tables(self) -> ReplayConfig:
        unknown = [t for t in self.ingest_tables if t not in self.tables]
        if unknown:
            raise ValueError(f"ingest_tables {unknown} are not configured tables {sorted(self.tables)}")
        return self
