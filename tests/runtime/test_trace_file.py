"""The trace file (``trace_file``: spans as JSON lines) and the gRPC calls that are never traced (the polled
status reads of ``UNTRACED_METHODS``)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from temper.runtime.tracing import UNTRACED_METHODS, build_provider, traced_method
from tests.conftest import REPO

PROTOS = REPO / "protos" / "temper" / "v1"


def test_each_span_is_one_json_line_with_its_context_parent_links_events_and_status(tmp_path):
    path = tmp_path / "svc.spans.jsonl"
    provider = build_provider("replay", trace_file=str(path))
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("other") as other:
        pass
    link = trace.Link(other.get_span_context(), {"why": "trained"})
    with (tracer.start_as_current_span("parent", attributes={"temper.job_id": "j", "n": 3}) as parent,
          tracer.start_as_current_span("child", kind=trace.SpanKind.CONSUMER, links=[link]) as child):
        child.add_event("drawn", {"groups": 4})
        child.set_status(Status(StatusCode.ERROR, "bad group"))
    provider.shutdown()  # flushes the batch and closes the file
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and all(line.startswith("{") for line in lines)
    by_name = {r["name"]: r for r in map(json.loads, lines)}
    p, c = by_name["parent"], by_name["child"]
    assert p["service"] == c["service"] == "temper-replay"
    assert p["context"] == {"trace_id": f"0x{parent.get_span_context().trace_id:032x}",
                            "span_id": f"0x{parent.get_span_context().span_id:016x}"}
    assert p["parent_id"] is None and p["kind"] == "INTERNAL" and p["attributes"] == {"temper.job_id": "j", "n": 3}
    assert c["parent_id"] == p["context"]["span_id"] and c["context"]["trace_id"] == p["context"]["trace_id"]
    assert c["kind"] == "CONSUMER"
    assert c["status"] == {"status_code": "ERROR", "description": "bad group"}
    assert c["links"] == [{"context": by_name["other"]["context"], "attributes": {"why": "trained"}}]
    assert [(e["name"], e["attributes"]) for e in c["events"]] == [("drawn", {"groups": 4})]
    assert p["start_time_unix_nano"] <= c["start_time_unix_nano"] <= c["end_time_unix_nano"] <= p["end_time_unix_nano"]


def test_a_second_process_appends_to_the_file(tmp_path):
    path = tmp_path / "svc.spans.jsonl"
    for name in ("first", "second"):  # a restarted service keeps its earlier spans
        provider = build_provider("svc", trace_file=str(path))
        with provider.get_tracer("t").start_as_current_span(name):
            pass
        provider.shutdown()
    assert [json.loads(line)["name"] for line in path.read_text().splitlines()] == ["first", "second"]


def _all_methods() -> set[str]:
    """Every method of the protos' services and of gRPC's health service, as '/package.Service/Method'."""
    from google.protobuf import descriptor_pool
    from grpc_health.v1 import health_pb2

    import temper.v1  # noqa: F401 - the package's modules register their files in the default pool
    from temper.client import sdk  # noqa: F401 - imports every service's generated module

    pool = descriptor_pool.Default()
    names = set()
    for file in [*(f"temper/v1/{p.name}" for p in PROTOS.glob("*.proto")), health_pb2.DESCRIPTOR.name]:
        for service in pool.FindFileByName(file).services_by_name.values():
            names |= {f"/{service.full_name}/{m.name}" for m in service.methods}
    return names


def test_polled_status_reads_are_not_traced_and_every_data_call_is():
    methods = _all_methods()
    assert methods >= UNTRACED_METHODS, UNTRACED_METHODS - methods  # a renamed method would be traced again
    for method in UNTRACED_METHODS:
        assert not traced_method(SimpleNamespace(method=method)), method
        assert not traced_method(SimpleNamespace(full_method=method)), method  # the client interceptor's call info
        assert not traced_method(SimpleNamespace(method=method.encode())), method  # grpc.aio passes bytes
    for method in ("/temper.v1.InferenceService/Generate", "/temper.v1.InferenceService/UpdateWeights",
                   "/temper.v1.ReplayService/Sample", "/temper.v1.ReplayService/Insert",
                   "/temper.v1.RewardService/Score", "/temper.v1.SandboxService/RunTests",
                   "/temper.v1.SchedulerService/StartJob", "/temper.v1.LearnerService/ExportPolicy"):
        assert traced_method(SimpleNamespace(method=method)), method
        assert traced_method(SimpleNamespace(full_method=method)), method
