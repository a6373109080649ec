"""gRPC ReplayService: translates protobuf <-> the store."""

from __future__ import annotations

from temper.replay.store import ReplayStore
from temper.runtime.errors import Unimplemented, require
from temper.v1 import replay_pb2, replay_pb2_grpc


class ReplayServicer(replay_pb2_grpc.ReplayServiceServicer):
    def __init__(self, store: ReplayStore, max_batch: int, max_timeout_ms: int):
        self.store = store
        self.max_batch = max_batch
        self.max_timeout_ms = max_timeout_ms

    def Insert(self, request_iterator, context):
        by_table: dict[str, list] = {}
        for i, req in enumerate(request_iterator):
            require(req.HasField("group"), f"requests[{i}].group", "required")
            by_table.setdefault(req.table, []).append(req.group)
        inserted = duplicates = 0
        for table, groups in by_table.items():
            n, d = self.store.insert(table, groups)
            inserted, duplicates = inserted + n, duplicates + d
        return replay_pb2.InsertResponse(inserted=inserted, duplicates=duplicates)

    def Sample(self, request, context):
        require(0 <= request.timeout_ms <= self.max_timeout_ms, "timeout_ms",
                f"must be in [0, {self.max_timeout_ms}], got {request.timeout_ms}")
        groups = self.store.sample(request.table, request.batch_size, request.timeout_ms / 1000, self.max_batch)
        return replay_pb2.SampleResponse(groups=groups)

    def UpdatePriorities(self, request, context):
        raise Unimplemented("prioritized tables arrive with the replay issue")

    def Stats(self, request, context):
        s = self.store.stats(request.table)
        return replay_pb2.StatsResponse(table=s.table, size=s.size, inserts=s.inserts, samples=s.samples,
                                        duplicates=s.duplicates, domain_counts=s.domain_counts)
