"""gRPC ReplayService: translates protobuf <-> the store.

Groups cross this service as bytes where it can: ``Insert`` parses requests as wire views
(``wire.py``: the token and logprob arrays stay undecoded bytes), keeps each group's bytes as
received and stores them as they are, and ``Sample`` frames the
stored bytes as field 1 of ``SampleResponse`` itself (``register`` installs a serializer that
passes bytes through), so a 56 KB group is never parsed and serialized again on its way.
"""

from __future__ import annotations

import math

import grpc

from temper.replay.store import ReplayStore, SampleResult
from temper.client.transport import wire_bytes
from temper.replay.wire import decode_insert_request, varint
from temper.runtime.errors import reject_unknown_fields, require
from temper.runtime.rpc import add_service
from temper.v1 import replay_pb2, replay_pb2_grpc

SERVICE = replay_pb2.DESCRIPTOR.services_by_name["ReplayService"]
ACK_ACTIONS = {replay_pb2.AckSampleRequest.ACTION_UNSPECIFIED: "ack", replay_pb2.AckSampleRequest.ACTION_REQUEUE: "requeue",
               replay_pb2.AckSampleRequest.ACTION_EXTEND: "extend"}


def encode_sample_response(result: SampleResult) -> bytes:
    """``SampleResponse`` wire bytes: stored group bytes framed as field 1, the rest serialized."""
    head = replay_pb2.SampleResponse(current_policy_version=result.policy_version, lease_id=result.lease_id, info=[
        replay_pb2.SampleInfo(group_id=d.group_id, probability=d.probability, importance_weight=d.importance_weight,
                              priority=d.priority, times_sampled=d.times_sampled, table_size=d.table_size,
                              policy_version=d.policy_version, inserted_unix_ms=d.inserted_ms)
        for d in result.draws])
    parts = [head.SerializeToString()]
    for d in result.draws:
        parts += (b"\x0a", varint(len(d.payload)), d.payload)  # tag of field 1, length-delimited
    return b"".join(parts)


class ReplayServicer(replay_pb2_grpc.ReplayServiceServicer):
    def __init__(self, store: ReplayStore, max_batch: int, max_timeout_ms: int, insert_timeout_ms: int):
        self.store = store
        self.max_batch = max_batch
        self.max_timeout_ms = max_timeout_ms
        self.insert_timeout_ms = insert_timeout_ms

    def _timeout(self, context, default_ms: int) -> float:
        left = context.time_remaining() if context is not None else None
        return default_ms / 1000 if left is None else max(0.0, min(left, self.max_timeout_ms / 1000))

    def Insert(self, request_iterator, context):
        by_table: dict[str, tuple[list, list, list, list]] = {}
        for i, (req, group, batch, raw, raws) in enumerate(request_iterator):
            require(group is not None or len(batch) > 0, f"requests[{i}].group", "required (or groups)")
            require(req.table in self.store.tables, f"requests[{i}].table",
                    f"unknown table {req.table!r}; known: {sorted(self.store.tables)}")
            require(not req.priorities or len(req.priorities) == len(batch), f"requests[{i}].priorities",
                    f"{len(req.priorities)} priorities for {len(batch)} groups (give none or one each)")
            groups, priorities, fields, payloads = by_table.setdefault(req.table, ([], [], [], []))
            if group is not None:
                groups.append(group)
                priorities.append(req.priority if req.HasField("priority") else None)
                fields.append(f"requests[{i}].group")
                payloads.append(raw)
            n = len(batch)
            groups.extend(batch)
            priorities.extend(req.priorities or [None] * n)
            fields.extend(f"requests[{i}].groups[{j}]" for j in range(n))
            payloads.extend(raws or [None] * n)
        # every group of every table is validated before anything is stored
        prepared = {table: self.store.prepare(*args) for table, args in by_table.items()}
        timeout = self._timeout(context, self.insert_timeout_ms)
        out = replay_pb2.InsertResponse()
        for table, pending in prepared.items():
            r = self.store.insert(table, pending, timeout=timeout)
            out.inserted += r.inserted
            out.duplicates += r.duplicates
            out.stale += r.stale
            out.evicted += r.evicted
        return out

    def _check_sample(self, request) -> None:
        reject_unknown_fields(request, "request")  # a setting this server does not know is refused, not ignored
        require(0 <= request.timeout_ms <= self.max_timeout_ms, "timeout_ms",
                f"must be in [0, {self.max_timeout_ms}], got {request.timeout_ms}")

    def _draw(self, request, context) -> SampleResult:
        """One batch as ``request`` (a SampleRequest or SampleStreamRequest) asks it."""
        timeout = request.timeout_ms / 1000
        left = context.time_remaining() if context is not None else None
        if left is not None:
            timeout = min(timeout, left)
        return self.store.sample(
            request.table, request.batch_size, timeout, self.max_batch,
            current_policy_version=(request.current_policy_version
                                    if request.HasField("current_policy_version") else None),
            importance_sampling_exponent=(request.importance_sampling_exponent
                                          if request.HasField("importance_sampling_exponent") else None),
            alive=context.is_active if context is not None else None, lease_s=request.lease_ms / 1000)

    def Sample(self, request, context):
        self._check_sample(request)
        return encode_sample_response(self._draw(request, context))

    def SampleStream(self, request, context):
        self._check_sample(request)
        require(request.count >= 0, "count", f"must be >= 0 (0: until the caller cancels), got {request.count}")
        table = self.store.tables.get(request.table)
        require(table is None or request.lease_ms > 0 or not table.config.max_times_sampled, "lease_ms",
                f"must be > 0 on a stream from table {request.table!r}: its draws use groups up (max_times_sampled "
                f"{table.config.max_times_sampled if table else 0}), and batches drawn for a caller that cancels "
                "would be lost without a lease")
        sent = 0
        while request.count == 0 or sent < request.count:
            # SampleStreamResponse has SampleResponse's fields: the same bytes
            yield encode_sample_response(self._draw(request, context))
            sent += 1

    def AckSample(self, request, context):
        reject_unknown_fields(request, "request")
        action = ACK_ACTIONS.get(request.action)
        require(action is not None, "action", f"unknown action {request.action}")
        require(request.action == replay_pb2.AckSampleRequest.ACTION_EXTEND or request.extend_ms == 0, "extend_ms",
                "only with ACTION_EXTEND")
        return replay_pb2.AckSampleResponse(groups=self.store.ack(request.lease_id, action, request.extend_ms / 1000))

    def UpdatePriorities(self, request, context):
        reject_unknown_fields(request, "request")
        updated, unknown = self.store.update_priorities(request.table, dict(request.priorities))
        return replay_pb2.UpdatePrioritiesResponse(updated=updated, unknown_group_ids=unknown)

    def Stats(self, request, context):
        s = self.store.stats(request.table)
        lim, c = s.limiter, s.config
        return replay_pb2.StatsResponse(
            table=s.table, size=s.size, inserts=s.inserts, samples=s.samples, duplicates=s.duplicates,
            domain_counts=s.domain_counts, current_policy_version=s.policy_version, removed=s.removed,
            bytes=s.bytes, policy_version_counts=s.policy_version_counts,
            leases=s.leases, leased=s.leased, lease_outcomes=s.lease_outcomes, total_weight=s.total_weight,
            min_weight=s.min_weight,
            age_seconds=[replay_pb2.AgeBucket(upper_bound=b, count=n) for b, n in s.age_histogram],
            rate_limiter=replay_pb2.RateLimiterState(
                samples_per_insert=lim.samples_per_insert, min_size_to_sample=lim.min_size_to_sample,
                min_diff=lim.min_diff, max_diff=lim.max_diff, inserts=lim.inserts, samples=lim.samples,
                deletes=lim.deletes, diff=lim.diff if math.isfinite(lim.min_diff) else 0.0,
                can_insert=s.can_insert, can_sample=s.can_sample, waiting_inserts=s.waiting_inserts,
                waiting_samples=s.waiting_samples),
            config=replay_pb2.ReplayTableConfig(
                sampler=c.sampler, remover=c.remover, max_size=c.max_size, max_times_sampled=c.max_times_sampled,
                priority_exponent=c.priority_exponent, importance_sampling_exponent=c.importance_sampling_exponent,
                max_policy_lag=c.max_policy_lag, domain_quotas=c.domain_quotas))

    def Checkpoint(self, request, context):
        ckpt_id, size, sizes = self.store.checkpoint()
        return replay_pb2.ReplayServiceCheckpointResponse(checkpoint_id=ckpt_id, bytes=size, table_sizes=sizes)

    def Restore(self, request, context):
        return replay_pb2.ReplayServiceRestoreResponse(table_sizes=self.store.restore(request.checkpoint_id))


def register(servicer: ReplayServicer, server: grpc.Server) -> str:
    """Add ``servicer`` to ``server`` (Insert read as wire views, any method may answer pre-encoded bytes);
    returns the service name."""
    return add_service(servicer, server, SERVICE, {"Insert": decode_insert_request}, response_serializer=wire_bytes)
