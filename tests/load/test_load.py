"""Load with backpressure (slow tier): sustained concurrent SDK clients against the real sandbox (gVisor),
inference (the hf engine on a tiny model) and replay services, each started with a small
``max_concurrent_rpcs`` (sandbox: its own run slots and queue) so that the clients outnumber what it
serves at once. Each must: answer every call OK or RESOURCE_EXHAUSTED (shed, with retry advice that the
SDK follows), never another error; answer every health probe SERVING while loaded; and keep its memory
flat. p50/p99, throughput against one client alone (measured first, same run), shed and error rates are
printed (``-s``) and written to ``$TEMPER_LOAD_REPORT`` (JSON) when set.

Size: ``TEMPER_LOAD_SECONDS`` (default 8 per service) and ``TEMPER_LOAD_CLIENTS`` (default 16); a soak is
the same test with a long duration, e.g. ``TEMPER_LOAD_SECONDS=600``.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import pytest

from temper.client.sdk import InferenceClient, ReplayClient, SandboxClient
from temper.models.tiny import build_tiny_model
from tests.builders import scored_group
from tests.conftest import spawn_service
from tests.load.harness import LoadResult, run_load
from tests.sandbox.helpers import start_sandbox

pytestmark = pytest.mark.slow  # starts services

SECONDS = float(os.environ.get("TEMPER_LOAD_SECONDS", "8"))
CLIENTS = int(os.environ.get("TEMPER_LOAD_CLIENTS", "16"))
RESULTS: list[LoadResult] = []


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    for r in RESULTS:
        print("\n" + r.row())
    path = os.environ.get("TEMPER_LOAD_REPORT")
    if path:
        Path(path).write_text(json.dumps([r.as_dict() for r in RESULTS], indent=2))


def refusals(metrics_port: int) -> float:
    """Calls the service refused as busy: at its call limit, or (sandbox) with its run queue full."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("temper_rpc_shed_total{") or (
                line.startswith("temper_rpc_errors_total{") and 'code="RESOURCE_EXHAUSTED"' in line):
            total += float(line.split()[-1])
    return total


def check(result: LoadResult) -> None:
    RESULTS.append(result)
    assert result.errors == {}, result.row()
    assert result.ok > 0, result.row()
    assert result.shed_by_server > 0, f"the clients never met the limit: backpressure untested; {result.row()}"
    assert result.probes > 0 and result.probes_not_serving == 0, result.row()
    # flat memory: what the last quarter of the run needed, the first quarter needed too (within noise)
    assert result.rss_mib_last_quarter <= result.rss_mib_first_quarter * 1.15 + 32, result.row()


def test_replay_under_load(broker, tmp_path):
    svc = spawn_service("replay", tmp_path, "--max-concurrent-rpcs", "4", "--kafka-bootstrap", broker)
    try:
        with svc.client(ReplayClient) as c:
            c.insert([scored_group(f"stock-{i}") for i in range(200)])

        def call(client: ReplayClient, n: int) -> None:
            """An insert, then (if it got through) a sample: the table never runs dry, whatever is shed."""
            client.insert([scored_group(f"load-{n}")])
            assert len(client.sample_batch(1, timeout_ms=5000).groups) == 1

        check(run_load("replay", svc.address, svc.proc.pid, lambda: ReplayClient(svc.address, timeout=30), call,
                       CLIENTS, SECONDS, shed_counter=lambda: refusals(svc.metrics_port)))
    finally:
        svc.stop()


def test_inference_under_load(tmp_path):
    model = build_tiny_model(tmp_path / "tiny", seed=3, hidden_size=64, layers=2, heads=2)
    svc = spawn_service("inference", tmp_path, "--model-dir", str(model), "--engine", "hf", "--max-concurrent-rpcs",
                        "2", timeout=240)
    try:
        def call(client: InferenceClient, n: int) -> None:
            resp = client.generate(["the quick brown fox"], n=4, max_tokens=16, seed=n)
            assert len(resp.results[0].completions) == 4

        check(run_load("inference", svc.address, svc.proc.pid, lambda: InferenceClient(svc.address, timeout=60), call,
                       CLIENTS, SECONDS, shed_counter=lambda: refusals(svc.metrics_port)))
    finally:
        svc.stop()


def test_sandbox_under_load(tmp_path):
    svc = start_sandbox(tmp_path, "--max-concurrency", "2", "--max-queue", "2")
    try:
        def call(client: SandboxClient, n: int) -> None:
            resp = client.execute(f"print({n})", wall_seconds=10)
            assert resp.stdout == f"{n}\n".encode(), resp

        check(run_load("sandbox", svc.address, svc.proc.pid, lambda: SandboxClient(svc.address, timeout=60), call,
                       CLIENTS, SECONDS, shed_counter=lambda: refusals(svc.metrics_port)))
    finally:
        svc.stop()
