"""Reward-model training data from what the system produces: ``python -m temper.reward.dataset
--kafka-bootstrap HOST:PORT --out FILE`` reads the `scored` and `sandbox-traces` topics from their
beginning and writes JSON-lines records for ``temper.reward.train``.

* A scored group gives preference pairs (a completion with the group's highest total against one
  with its lowest, same prompt; at most ``max_pairs`` per group) and one outcome record per
  trajectory whose label is its verifier score: the weighted mean of its rule-based components
  (everything but rm, prm and length_penalty) with weight > 0, in [0, 1].
  Every outcome record names its ``job_id``, ``group_id``, ``task_id`` and ``trajectory_id``, the
  ``policy_version`` that sampled it, its ``finish_reason``, and its ``task`` (domain, reference answer,
  metadata: what the verifier needs to score the prompt again, as ``temper prm label`` does).
* Code trajectories: the sandbox's RunTests trace of a trajectory's program carries the
  trajectory's ids (``ExecutionTrace.origin``, set by the reward service), and the trajectory's
  outcome record is joined with it: ``tests`` (per test, in the suite's order: index, verdict,
  passed, exit_code, signal, message; a test the run never reached is ``NOT_RUN``) and
  ``test_labels`` (1.0 / 0.0 per test): a step-like signal of the program, one step per test.
* A RunTests trace with no origin (a direct caller of the sandbox) gives an outcome record of the
  program alone against the fraction of its tests it passed, with an empty prompt. A trace with
  an origin whose trajectories are not on `scored` (not scored yet, or scored in error) gives no
  record: it is counted as ``unjoined``.

Groups or trajectories whose reward is not OK are skipped (an unknown outcome is not a label).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from google.protobuf.message import DecodeError

from temper.v1 import common_pb2, sandbox_pb2

LEARNED = ("rm", "prm", "length_penalty")


def verifier_label(reward: common_pb2.Reward) -> float | None:
    parts = [(c.weight, c.value) for c in reward.components
             if c.name not in LEARNED and c.weight > 0 and c.status == common_pb2.REWARD_STATUS_OK]
    if not parts:
        return None
    label = sum(w * v for w, v in parts) / sum(w for w, _ in parts)
    return min(1.0, max(0.0, label))


def records_from_group(group: common_pb2.RolloutGroup, max_pairs: int = 4,
                       outcomes: dict[str, dict] | None = None) -> list[dict]:
    """``outcomes``: trajectory id -> ``per_test_outcomes(trace)`` of its program's execution trace."""
    trajs = [t for t in group.trajectories if t.reward.status == common_pb2.REWARD_STATUS_OK]
    prompt = group.task.prompt
    task = task_record(group.task)
    out = []
    for t in trajs:
        label = verifier_label(t.reward)
        if label is not None:
            rec = {"prompt": prompt, "completion": t.completion_text, "label": label, "job_id": group.job_id,
                   "group_id": group.group_id, "task_id": group.task.task_id, "trajectory_id": t.trajectory_id,
                   "policy_version": t.policy_version, "finish_reason": t.finish_reason, "task": task}
            rec.update((outcomes or {}).get(t.trajectory_id, {}))
            out.append(rec)
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


def task_record(task: common_pb2.Task) -> dict:
    """The task of an outcome record as JSON (what a verifier needs to score the prompt again: the step
    labeller, ``temper.reward.step_labels``); ``task_from_record`` reads it back."""
    return {"domain": task.domain, "reference_answer": task.reference_answer, "metadata": dict(task.metadata)}


def task_from_record(rec: dict) -> common_pb2.Task:
    t = rec["task"]
    return common_pb2.Task(task_id=rec.get("task_id", ""), domain=t["domain"], prompt=rec.get("prompt", ""),
                           reference_answer=t.get("reference_answer", ""), metadata=t.get("metadata", {}))


def per_test_outcomes(trace: sandbox_pb2.ExecutionTrace) -> dict | None:
    """The per-test outcome of a RunTests trace: ``{"tests": [...], "test_labels": [...], "execution_id"}``
    (see the module doc); None for an Execute trace or a run the sandbox itself failed."""
    if trace.method != "RunTests" or not trace.HasField("run_tests_request"):
        return None
    if trace.verdict == sandbox_pb2.VERDICT_SANDBOX_ERROR:
        return None
    resp = trace.run_tests_response
    compiled = resp.compile_verdict in (sandbox_pb2.VERDICT_OK, sandbox_pb2.VERDICT_UNSPECIFIED)
    tests = []
    for i in range(len(trace.run_tests_request.tests)):
        if i < len(resp.results):
            r = resp.results[i]
            verdict = sandbox_pb2.Verdict.Name(r.verdict).removeprefix("VERDICT_")
            tests.append({"index": i, "verdict": verdict, "passed": r.verdict == sandbox_pb2.VERDICT_OK,
                          "exit_code": r.exit_code, "signal": r.signal, "message": r.message})
        else:
            verdict = "NOT_RUN" if compiled else sandbox_pb2.Verdict.Name(resp.compile_verdict).removeprefix("VERDICT_")
            tests.append({"index": i, "verdict": verdict, "passed": False, "exit_code": 0, "signal": 0,
                          "message": "" if compiled else resp.compile.message})
    return {"execution_id": trace.execution_id, "tests": tests, "test_labels": [float(t["passed"]) for t in tests]}


def records_from_trace(trace: sandbox_pb2.ExecutionTrace) -> list[dict]:
    """The record of a trace with no origin: the program alone, with an empty prompt (see the module doc)."""
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


def read_topic(bootstrap: str, topic: str, message_type, idle_seconds: float = 2.0,
               undecodable: list[int] | None = None) -> Iterator:
    """Every message of ``topic`` from its beginning to its high watermark (no consumer group, nothing
    committed); one that does not decode is skipped (its offset appended to ``undecodable``)."""
    from kafka import KafkaConsumer, TopicPartition

    from temper.runtime.kafka import client_security

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None,
                             auto_offset_reset="earliest", fetch_max_wait_ms=100, **client_security())
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
                    try:
                        message = message_type.FromString(record.value)
                    except DecodeError:
                        if undecodable is not None:
                            undecodable.append(record.offset)
                        continue
                    yield message
            hw = {tp: consumer.highwater(tp) for tp in tps}
            if all(h is not None and consumer.position(tp) >= h for tp, h in hw.items()):
                return
    finally:
        consumer.close()


def export(bootstrap: str, out: str | Path, scored_topic: str = "scored", traces_topic: str = "sandbox-traces",
           max_pairs: int = 4, job_id: str = "") -> dict[str, int]:
    """Write the records of the topics to ``out``; their counts. ``job_id``: that job's groups and execution traces
    only (traces no job asked for are then left out)."""
    counts = {"groups": 0, "traces": 0, "records": 0, "joined": 0, "unjoined": 0, "undecodable": 0}
    undecodable: list[int] = []
    outcomes: dict[str, dict] = {}  # trajectory id -> its program's per-test outcome
    unlinked: list[dict] = []
    if traces_topic:
        for trace in read_topic(bootstrap, traces_topic, sandbox_pb2.ExecutionTrace, undecodable=undecodable):
            if job_id and trace.origin.job_id != job_id:
                continue
            counts["traces"] += 1
            if trace.origin.trajectory_ids:
                found = per_test_outcomes(trace)
                if found is not None:
                    outcomes.update((tid, found) for tid in trace.origin.trajectory_ids)
            else:
                unlinked.extend(records_from_trace(trace))
    used: set[str] = set()
    with open(out, "w") as f:
        for group in read_topic(bootstrap, scored_topic, common_pb2.RolloutGroup, undecodable=undecodable):
            if job_id and group.job_id != job_id:
                continue
            counts["groups"] += 1
            for rec in records_from_group(group, max_pairs, outcomes):
                if "tests" in rec:
                    used.add(rec["trajectory_id"])
                f.write(json.dumps(rec) + "\n")
                counts["records"] += 1
        for rec in unlinked:
            f.write(json.dumps(rec) + "\n")
            counts["records"] += 1
    counts["joined"] = len(used)
    counts["unjoined"] = len(set(outcomes) - used)
    counts["undecodable"] = len(undecodable)
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
