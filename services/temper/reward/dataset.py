"""Reward-model training data from what the system produces: ``python -m temper.reward.dataset
--kafka-bootstrap HOST:PORT --out FILE`` reads the `scored` and `sandbox-traces` topics from their
beginning and writes JSON-lines records for ``temper.reward.train``.

* A scored group gives preference pairs (a completion with the group's highest total against one
  with its lowest, same prompt; at most ``max_pairs`` per group) and one outcome record per
  trajectory whose label is its verifier score: the weighted mean of its rule-based components
  (everything but rm, prm and length_penalty) with weight > 0, in [0, 1].
* A sandbox RunTests trace gives an outcome record: the program against the fraction of its
  tests it passed (the trace carries no prompt: the record's prompt is empty).

Groups or trajectories whose reward is not OK are skipped (an unknown outcome is not a label).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from temper.v1 import common_pb2, sandbox_pb2

LEARNED = ("rm", "prm", "length_penalty")


def verifier_label(reward: common_pb2.Reward) -> float | None:
    parts = [(c.weight, c.value) for c in reward.components
             if c.name not in LEARNED and c.weight > 0 and c.status == common_pb2.REWARD_STATUS_OK]
    if not parts:
        return None
    label = sum(w * v for w, v in parts) / sum(w for w, _ in parts)
    return min(1.0, max(0.0, label))


def records_from_group(group: common_pb2.RolloutGroup, max_pairs: int = 4) -> list[dict]:
    trajs = [t for t in group.trajectories if t.reward.status == common_pb2.REWARD_STATUS_OK]
    prompt = group.task.prompt
    out = []
    for t in trajs:
        label = verifier_label(t.reward)
        if label is not None:
            out.append({"prompt": prompt, "completion": t.completion_text, "label": label})
    if len(trajs) >= 2:
        best = max(t.reward.total for t in trajs)
        worst = min(t.reward.total for t in trajs)
        if best > worst:
            chosen = [t for t in trajs if t.reward.total == best]
            rejected = [t for t in trajs if t.reward.total == worst]
            for k in range(min(max_pairs, max(len(chosen), len(rejected)))):
                out.append({"prompt": prompt, "chosen": chosen[k % len(chosen)].completion_text,
                            "rejected": rejected[k % len(rejected)].completion_text})
    return out


def records_from_trace(trace: sandbox_pb2.ExecutionTrace) -> list[dict]:
    if trace.method != "RunTests" or not trace.HasField("run_tests_request"):
        return []
    req, resp = trace.run_tests_request, trace.run_tests_response
    n = len(req.tests)
    if n == 0 or trace.verdict == sandbox_pb2.VERDICT_SANDBOX_ERROR:
        return []
    sources = [f.content for f in req.program.files if f.path == ""] or [f.content for f in req.program.files]
    if not sources:
        return []
    return [{"prompt": "", "completion": sources[0].decode(errors="replace"), "label": resp.passed / n}]


def read_topic(bootstrap: str, topic: str, message_type, idle_seconds: float = 2.0) -> Iterator:
    """Every message of ``topic`` from its beginning to its high watermark (no consumer group, nothing committed)."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None,
                             auto_offset_reset="earliest", fetch_max_wait_ms=100)
    try:
        partitions = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        if not tps:
            return
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        last = time.monotonic()
        while time.monotonic() - last < idle_seconds:
            batches = consumer.poll(timeout_ms=200)
            for records in batches.values():
                for record in records:
                    last = time.monotonic()
                    yield message_type.FromString(record.value)
            hw = {tp: consumer.highwater(tp) for tp in tps}
            if all(h is not None and consumer.position(tp) >= h for tp, h in hw.items()):
                return
    finally:
        consumer.close()


def export(bootstrap: str, out: str | Path, scored_topic: str = "scored", traces_topic: str = "sandbox-traces",
           max_pairs: int = 4) -> dict[str, int]:
    counts = {"groups": 0, "traces": 0, "records": 0}
    with open(out, "w") as f:
        for group in read_topic(bootstrap, scored_topic, common_pb2.RolloutGroup):
            counts["groups"] += 1
            for rec in records_from_group(group, max_pairs):
                f.write(json.dumps(rec) + "\n")
                counts["records"] += 1
        if traces_topic:
            for trace in read_topic(bootstrap, traces_topic, sandbox_pb2.ExecutionTrace):
                counts["traces"] += 1
                for rec in records_from_trace(trace):
                    f.write(json.dumps(rec) + "\n")
                    counts["records"] += 1
    return counts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m temper.reward.dataset", description=__doc__.split("\n")[0])
    ap.add_argument("--kafka-bootstrap", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--scored-topic", default="scored")
    ap.add_argument("--traces-topic", default="sandbox-traces", help='"" to skip execution traces')
    ap.add_argument("--max-pairs", type=int, default=4, help="preference pairs per group")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    print(json.dumps(export(args.kafka_bootstrap, args.out, args.scored_topic, args.traces_topic, args.max_pairs)))


if __name__ == "__main__":
    main()
