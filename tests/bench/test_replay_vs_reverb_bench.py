"""Replay side by side with DeepMind Reverb 0.14 on Reverb's own work, in one bench run.

The work (tests/bench/reverb_peer.py does Reverb's side): items of 2,048 tokens + 2,048 logprobs +
a reward (Reverb: int32/f32 tensors, 16 KiB; Temper: a RolloutGroup of one trajectory, the same
numbers as protobuf); insert ``ITEMS`` with 1 writer into a uniform table and with 4 writers
(threads, a client each) into a prioritized one with random priorities; then sample batches of
64 from each. Both servers are separate processes from their clients, on loopback. Reverb runs
before and after Temper and its better figure of each counts.

Temper's clients start from RolloutGroup messages in hand (as Reverb's start from numpy arrays)
and go through the SDK: ``ReplayClient.insert_future`` (batch messages, one call per 256 groups,
answered once durable, two calls in flight per writer) and ``ReplayClient.sample_batches``
(groups parsed, with SampleInfo; one SampleStream call for all the batches, as Reverb's sampler streams;
one Sample call per batch reported beside it).
Temper runs twice, ``fsync = false`` (durable against kill -9, as Reverb's in-memory tables are
not even that) and ``fsync = true`` (durable against an OS crash too). Goal: >= 1.0x Reverb with
fsync off. Run: ``make bench-peers`` once, then ``make bench``.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from temper.client.sdk import ReplayClient
from temper.v1 import common_pb2
from tests.replay.util import start_replay

REVERB_VENV = Path(os.environ.get("TEMPER_REVERB_VENV", "/work/bench-venvs/reverb"))
REVERB_PYTHON = REVERB_VENV / "bin" / "python"
PEER = Path(__file__).with_name("reverb_peer.py")
ITEMS = int(os.environ.get("TEMPER_BENCH_REPLAY_ITEMS", "8192"))
SAMPLE_BATCHES, BATCH, TOKENS, CALL = 150, 64, 2048, 256
IN_FLIGHT = 2  # insert calls a writer keeps outstanding (Reverb: 32 unconfirmed items per writer)
CONFIG = """
[replay]
ingest_tables = []
max_concurrent_rpcs = 8
fsync = {fsync}

[replay.tables.uniform]
sampler = "uniform"
max_times_sampled = 0
max_size = 100000

[replay.tables.prioritized]
sampler = "prioritized"
max_times_sampled = 0
max_size = 100000
"""


def groups(n: int, prefix: str) -> list[common_pb2.RolloutGroup]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        gid = f"{prefix}{i}"
        g = common_pb2.RolloutGroup(group_id=gid, task=common_pb2.Task(domain="bench"))
        t = g.trajectories.add(trajectory_id=gid, group_id=gid, policy_version=0,
                               completion_token_ids=rng.integers(0, 50_000, TOKENS, dtype=np.int32).tolist(),
                               completion_logprobs=(-rng.random(TOKENS, dtype=np.float32)).tolist())
        t.reward.total, t.reward.status = float(rng.random()), common_pb2.REWARD_STATUS_OK
        out.append(g)
    return out


def insert(address: str, table: str, items: list, priorities: list[float] | None, writers: int) -> float:
    def write(part: range) -> None:
        client = ReplayClient(address, timeout=300)
        in_flight: list = []
        try:
            for k in range(part.start, part.stop, CALL):
                stop = min(k + CALL, part.stop)
                in_flight.append((client.insert_future(items[k:stop], table, priorities[k:stop] if priorities else None),
                                  stop - k))
                if len(in_flight) >= IN_FLIGHT:
                    future, n = in_flight.pop(0)
                    assert future.result().inserted == n
            for future, n in in_flight:
                assert future.result().inserted == n
        finally:
            client.close()

    n = len(items)
    threads = [threading.Thread(target=write, args=(range(i * n // writers, (i + 1) * n // writers),))
               for i in range(writers)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return n / (time.perf_counter() - t0)


def sample(address: str, table: str, batches: int) -> dict[str, float]:
    """Items/s sampled over one SampleStream call (``sample_batches``: what counts, as Reverb's client streams
    its samples too) and, for reference, with one Sample call per batch."""
    client = ReplayClient(address, timeout=300)
    try:
        client.sample_batch(BATCH, table)
        out = {}
        t0 = time.perf_counter()
        for r in client.sample_batches(BATCH, table, count=batches):
            assert len(r.groups) == BATCH and len(r.groups[0].trajectories[0].completion_token_ids) == TOKENS
        out["stream"] = batches * BATCH / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(batches):
            r = client.sample_batch(BATCH, table)
            assert len(r.groups) == BATCH and len(r.groups[0].trajectories[0].completion_token_ids) == TOKENS
        out["unary"] = batches * BATCH / (time.perf_counter() - t0)
        return out
    finally:
        client.close()


def temper_side(home: Path, model_dir: Path, fsync: bool, items: list, priorities: list[float]) -> dict:
    launcher, _ = start_replay(home, model_dir, CONFIG.format(fsync=str(fsync).lower()))
    try:
        address = launcher.load().services["replay"].address
        out = {"item_bytes": items[0].ByteSize(),
               "insert_1": insert(address, "uniform", items, None, 1),
               "insert_4": insert(address, "prioritized", items, priorities, 4)}
        for t in ("uniform", "prioritized"):
            out[f"sample_{t}_ways"] = ways = sample(address, t, SAMPLE_BATCHES)
            out[f"sample_{t}"] = ways["stream"]
        return out
    finally:
        launcher.down()


def reverb_side() -> dict:
    # a fresh network namespace: Reverb's [::]:port is then loopback only, and the port is free
    cmd = f"ip link set lo up && exec {REVERB_PYTHON} {PEER} 9000 {ITEMS} {SAMPLE_BATCHES}"
    out = subprocess.run(["unshare", "--net", "bash", "-c", cmd], capture_output=True, text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 0 and lines, f"reverb side failed ({out.returncode}): {out.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.fixture
def replay_model_dir(tmp_path) -> Path:
    return tmp_path / "tiny"  # the launcher builds a tiny model there; replay never loads it


@pytest.mark.bench
@pytest.mark.skipif(not (REVERB_VENV / ".installed").exists(), reason=f"no Reverb bench venv at {REVERB_VENV} "
                    "(make bench-peers creates it)")
def test_replay_vs_reverb(tmp_path, replay_model_dir):
    items = groups(ITEMS, "g")
    priorities = (0.1 + np.random.default_rng(1).random(ITEMS)).tolist()
    # the machine is shared and its load comes and goes: Reverb runs before and after Temper and
    # keeps its better figure of each (so the ratios are, if anything, against Temper)
    runs = [reverb_side()]
    temper = {fsync: temper_side(tmp_path / f"fsync-{fsync}", replay_model_dir, fsync, items, priorities)
              for fsync in (False, True)}
    runs.append(reverb_side())
    reverb = {k: max(r[k] for r in runs) for k in runs[0] if not isinstance(runs[0][k], dict)}
    print("\nReverb runs (before, after):", json.dumps(runs))
    print("Temper's sampling, one stream vs a call per batch (fsync off, on):",
          json.dumps({f"fsync {fsync} {k}": v for fsync in (False, True) for k, v in temper[fsync].items()
                      if k.endswith("_ways")}))
    print(f"\nreplay vs DeepMind Reverb 0.14, {ITEMS} items of {TOKENS} tokens + {TOKENS} logprobs + reward "
          f"(Reverb {reverb['item_bytes']} B, Temper {temper[False]['item_bytes']} B as protobuf); "
          f"sample: {SAMPLE_BATCHES} batches of {BATCH}; items/s")
    print(f"  {'':<20}{'Reverb':>9}{'fsync off':>11}{'ratio':>7}{'fsync on':>11}{'ratio':>7}")
    for key, name in (("insert_1", "insert, 1 writer"), ("insert_4", "insert, 4 writers"),
                      ("sample_uniform", "sample uniform"), ("sample_prioritized", "sample prioritized")):
        r, off, on = reverb[key], temper[False][key], temper[True][key]
        print(f"  {name:<20}{r:9.0f}{off:11.0f}{off / r:6.2f}x{on:11.0f}{on / r:6.2f}x")
    assert all(v[k] > 0 for v in (reverb, *temper.values()) for k in ("insert_1", "sample_uniform"))
