"""Trace sampling (``trace_sample_ratio``): by trace id at the root, whole traces across services, the learner
step kept with the steps it links to; and the launcher's ``[launcher]`` telemetry keys."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from temper.runtime.config import load_config
from temper.runtime.launcher import Launcher
from temper.runtime.tracing import build_provider, links_to
from temper.replay.config import ReplayConfig


def _tracer(ratio: float):
    provider = build_provider("t", sample_ratio=ratio)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("t"), exporter


def _roots(tracer, n: int) -> None:
    for _ in range(n):
        with tracer.start_as_current_span("root"):
            pass


@pytest.mark.parametrize("ratio, low, high", [(1.0, 2000, 2000), (0.0, 0, 0), (0.25, 400, 600)])
def test_roots_are_kept_in_proportion(ratio, low, high):
    tracer, exporter = _tracer(ratio)
    _roots(tracer, 2000)
    # 0.25: 500 expected, std sqrt(2000 * 0.25 * 0.75) ~ 19, so [400, 600] is beyond 5 standard deviations
    assert low <= len(exporter.get_finished_spans()) <= high


def _remote(sampled: bool) -> trace.Span:
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    return NonRecordingSpan(SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=flags))


def test_a_child_follows_its_remote_parent_whatever_the_ratio():
    for ratio, sampled in ((0.0, True), (1.0, False)):
        tracer, exporter = _tracer(ratio)
        with tracer.start_as_current_span("child", context=trace.set_span_in_context(_remote(sampled))):
            pass
        assert len(exporter.get_finished_spans()) == int(sampled), (ratio, sampled)


def test_a_root_with_links_follows_them():
    kept, dropped = _remote(True).get_span_context(), _remote(False).get_span_context()
    tracer, exporter = _tracer(0.0)  # kept when any linked span was, whatever the ratio
    with tracer.start_as_current_span("learner.step", links=[trace.Link(dropped), trace.Link(kept)]):
        pass
    with tracer.start_as_current_span("learner.step", links=[trace.Link(dropped)]):
        pass
    with tracer.start_as_current_span("learner.step"):  # no links: the ratio
        pass
    assert len(exporter.get_finished_spans()) == 1
    tracer, exporter = _tracer(1 - 1e-9)  # dropped with the spans it links to (not kept by its own id)
    for _ in range(20):
        with tracer.start_as_current_span("learner.step", links=[trace.Link(dropped)]):
            pass
    with tracer.start_as_current_span("learner.step"):
        pass
    assert len(exporter.get_finished_spans()) == 1
    # links_to (the learner's links to the carriers of its groups) keeps the sampled flag
    carrier = {"traceparent": "00-00000000000000000000000000000abc-0000000000000def-01"}
    assert links_to([carrier])[0].context.trace_flags.sampled


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_a_ratio_outside_0_1_is_refused(bad):
    with pytest.raises(ValueError, match="between 0 and 1"):
        build_provider("t", sample_ratio=bad)
    with pytest.raises(Exception, match="trace_sample_ratio"):
        load_config(ReplayConfig, ["--trace-sample-ratio", str(bad)])


def _flag(args, flag):
    return args[args.index(flag) + 1] if flag in args else None


def test_the_launcher_starts_services_with_the_launcher_tables_telemetry(tmp_path):
    launcher = Launcher(home=tmp_path / "home")
    default = launcher.service_flags("reward", {}, None, {}, "")
    assert _flag(default, "--trace-file") == str(tmp_path / "home/logs/reward.spans.jsonl")
    assert _flag(default, "--metrics-port") == "0" and _flag(default, "--trace-sample-ratio") == "1.0"
    quiet = launcher.service_flags("reward", {"launcher": {"traces": False, "metrics": False,
                                                           "trace_sample_ratio": 0.25}}, None, {}, "")
    assert "--trace-file" not in quiet
    assert _flag(quiet, "--metrics-port") == "-1" and _flag(quiet, "--trace-sample-ratio") == "0.25"
    with pytest.raises(ValueError, match=r"launcher\.trace_sample_ratio"):
        launcher.service_flags("reward", {"launcher": {"trace_sample_ratio": 2}}, None, {}, "")
    with pytest.raises(ValueError, match=r"launcher\.traces"):
        launcher.service_flags("reward", {"launcher": {"traces": "yes please"}}, None, {}, "")
