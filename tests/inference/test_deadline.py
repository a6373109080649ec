"""Generation stops for a caller that has gone: the HF engine on the tiny model, and the real service over gRPC."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest

from temper.client.sdk import InferenceClient
from temper.inference.engine import SamplingParams
from temper.runtime.errors import DeadlineExceeded
from tests.conftest import spawn_service, wait_until
from tests.inference.conftest import make_engine

LONG = SamplingParams(n=8, temperature=1.0, max_tokens=100)  # the tiny model's context is 128 tokens


@pytest.fixture(scope="module")
def hf(tiny_dir):
    e = make_engine("hf", tiny_dir)
    yield e
    e.close()


class Polls:
    """A ``cancelled`` that turns true at its ``after``-th poll (counting every poll)."""

    def __init__(self, after: int):
        self.after, self.polls = after, 0

    def __call__(self) -> bool:
        self.polls += 1
        return self.polls >= self.after


def test_a_caller_gone_before_admission_costs_no_generation(hf):
    before = hf.cancelled_jobs
    gone = Polls(after=1)
    with pytest.raises(DeadlineExceeded):
        hf.generate([hf.encode("copy 1 2 3")], LONG, cancelled=gone)
    assert gone.polls == 1 and hf.cancelled_jobs == before + 1  # dropped at admission: no step ever ran
    results, _ = hf.generate([hf.encode("copy 1 2 3")], SamplingParams(n=2, max_tokens=4))  # still serving
    assert len(results[0].completions) == 2


def test_a_caller_gone_mid_generation_stops_it_at_the_next_token(hf):
    before = hf.cancelled_jobs
    gone = Polls(after=5)  # admission, the step's check, then once per generated token
    with pytest.raises(DeadlineExceeded):
        hf.generate([hf.encode("copy 1 2 3"), hf.encode("next 4")], LONG, cancelled=gone)
    # without the check the engine would poll nothing and generate all 100 tokens; it stopped within a token
    assert gone.polls <= 7, gone.polls
    assert hf.cancelled_jobs == before + 1


def _cancelled_metric(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("temper_inference_cancelled_generations ")))


@pytest.mark.slow
def test_the_service_stops_generating_once_the_calls_deadline_passed(tiny_dir, tmp_path):
    svc = spawn_service("inference", tmp_path, "--model-dir", str(tiny_dir), "--engine", "hf", "--dtype", "float32")
    try:
        with svc.client(InferenceClient, timeout=120) as client:
            assert _cancelled_metric(svc.metrics_port) == 0
            # ~2000 sequences x 100 tokens: seconds of work on the tiny model, far past a 0.3 s deadline
            with InferenceClient(svc.address, timeout=0.3) as hurried, pytest.raises(grpc.RpcError) as e:
                hurried.generate(["copy 1 2 3"], n=2048, max_tokens=100)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            t0 = time.monotonic()
            wait_until(lambda: _cancelled_metric(svc.metrics_port) == 1, 120, interval=0.1,
                       what="the engine dropped the expired generation")
            dropped_after = time.monotonic() - t0
            resp = client.generate(["copy 1 2 3"], n=2, max_tokens=4)  # and the engine serves the next caller
            assert len(resp.results[0].completions) == 2
            print(f"expired generation dropped {dropped_after:.2f}s after the caller's deadline")
    finally:
        svc.stop()
