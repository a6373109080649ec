"""DeepMind Reverb's side of the replay benchmark (run by tests/bench/test_replay_bench.py).

Runs in the bench-only environment (``make bench-peers``: dm-reverb 0.14 + tensorflow-cpu 2.15,
never a dependency of Temper), inside ``unshare --net`` so that ``reverb.Server``, which always
listens on ``[::]:port``, is reachable on loopback only. Prints one JSON line of results.

The work (the same on Temper's side): items of 2,048 int32 tokens + 2,048 f32 logprobs + an f32
reward (16 KiB); insert ``N`` items with 1 writer into a uniform table and with 4 writers into a
prioritized one (random priorities), each writer the idiomatic fast way (one trajectory_writer
per thread, ``create_item`` per step, ``flush(block_until_num_items=32)``); then sample batches
of 64 from each table, both through a ``TrajectoryDataset`` batched by 64 and ``Client.sample``
(the faster of the two counts).

Usage: python reverb_peer.py PORT ITEMS SAMPLE_BATCHES
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np
import reverb
import tensorflow as tf

TOKENS, BATCH = 2048, 64


def item(rng: np.random.Generator) -> dict:
    return {"tokens": rng.integers(0, 50_000, TOKENS, dtype=np.int32),
            "logprobs": -rng.random(TOKENS, dtype=np.float32),
            "reward": np.float32(rng.random())}


def insert(client: reverb.Client, table: str, items: list[dict], priorities: list[float], writers: int) -> float:
    """Items per second with ``writers`` threads, each inserting its share."""
    def write(part: range) -> None:
        with client.trajectory_writer(num_keep_alive_refs=1) as w:
            for k in part:
                w.append(items[k])
                w.create_item(table, priority=priorities[k],
                              trajectory={name: w.history[name][-1] for name in ("tokens", "logprobs", "reward")})
                w.flush(block_until_num_items=32)
            w.flush()

    n = len(items)
    parts = [range(i * n // writers, (i + 1) * n // writers) for i in range(writers)]
    threads = [threading.Thread(target=write, args=(p,)) for p in parts]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return n / (time.perf_counter() - t0)


def sample(client: reverb.Client, address: str, table: str, batches: int) -> dict:
    """Items per second, batches of 64, two ways (first batch not timed): a TrajectoryDataset
    batched by 64 (TF's pipeline) and ``Client.sample`` streaming 64 x batches items (numpy)."""
    ds = reverb.TrajectoryDataset.from_table_signature(
        server_address=address, table=table, max_in_flight_samples_per_worker=2 * BATCH).batch(BATCH)
    it = iter(ds)
    next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        b = next(it)
        assert b.data["tokens"].shape == (BATCH, TOKENS)
    dataset = batches * BATCH / (time.perf_counter() - t0)
    stream = client.sample(table, num_samples=(batches + 1) * BATCH, emit_timesteps=False,
                           unpack_as_table_signature=True)
    for _ in range(BATCH):
        next(stream)
    t0 = time.perf_counter()
    for _ in range(batches * BATCH):
        s = next(stream)
        assert s.data["tokens"].shape == (TOKENS,)
    return {"dataset": dataset, "client": batches * BATCH / (time.perf_counter() - t0)}


def serve(port: int, n: int) -> None:
    """The server process: two tables, until stdin closes."""
    spec = {"tokens": tf.TensorSpec([TOKENS], tf.int32), "logprobs": tf.TensorSpec([TOKENS], tf.float32),
            "reward": tf.TensorSpec([], tf.float32)}
    tables = [reverb.Table(name, sampler=sampler, remover=reverb.selectors.Fifo(), max_size=10 * n,
                           rate_limiter=reverb.rate_limiters.MinSize(1), max_times_sampled=0, signature=spec)
              for name, sampler in (("uniform", reverb.selectors.Uniform()),
                                    ("prioritized", reverb.selectors.Prioritized(1.0)))]
    server = reverb.Server(tables, port=port)
    print("ready", flush=True)
    sys.stdin.read()
    server.stop()


def measure(port: int, n: int, batches: int) -> None:
    """The client process (a separate one: in the server's own process Reverb skips gRPC)."""
    address = f"localhost:{port}"
    client = reverb.Client(address)
    client.server_info(timeout=60)  # waits for the server
    rng = np.random.default_rng(0)
    items = [item(rng) for _ in range(n)]
    priorities = (0.1 + rng.random(n)).tolist()
    out = {"item_bytes": int(sum(v.nbytes for v in items[0].values())),
           "insert_1": insert(client, "uniform", items, [1.0] * n, 1),
           "insert_4": insert(client, "prioritized", items, priorities, 4),
           **{f"sample_{t}_ways": sample(client, address, t, batches) for t in ("uniform", "prioritized")}}
    for t in ("uniform", "prioritized"):
        out[f"sample_{t}"] = max(out[f"sample_{t}_ways"].values())
    print(json.dumps(out), flush=True)


def main() -> None:
    """``PORT ITEMS BATCHES``: server and client as two processes (the port is free: a fresh
    network namespace has nothing else in it)."""
    port, n, batches = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    if sys.argv[4:5] == ["serve"]:
        serve(port, n)
        return
    tf.config.threading.set_inter_op_parallelism_threads(2)
    server = subprocess.Popen([sys.executable, __file__, *sys.argv[1:4], "serve"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        if server.stdout.readline().strip() != "ready":
            raise SystemExit("reverb server did not start")
        measure(port, n, batches)
    finally:
        server.stdin.close()
        server.wait(30)


if __name__ == "__main__":
    main()
