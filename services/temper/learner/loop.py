"""The learner's service loop: replay -> trainer -> inference replicas -> metrics, checkpoints.

Kept apart from the trainer so the maths stays testable alone; this file holds the I/O.
Invariants: one step at a time (a lock serialises steps, checkpoints and pauses); once
``pause()`` returns no update runs until ``resume()``; a batch sampled while pausing is kept
and trained on after resume, never dropped (a leased one is given back to replay instead). With
``sample_lease_s`` > 0 each batch is a replay lease: renewed every third of its length while its step
runs, acknowledged after the step (requeued if the step raised), so a learner killed mid-step loses
no group -- replay hands the batch to the next caller when the lease runs out (at least once).
Exactly once on top of that: the learner remembers the draws it consumed (group id and replay's
times_sampled, which a draw given back and made again repeats, while a deliberate re-draw of a reuse
table counts up), in its checkpoints too, and drops a draw it consumed already (an acknowledgement lost
with a replay restart, a lease that ran out under a slow step), counted as ``duplicate``. A learner
resumed from an older checkpoint forgets the draws after it, whose updates died with its process: they
are trained again.
A bad group never stalls the job: it is dropped by
the rule of temper.learner.batching.screen_groups (reward error, malformed, too long; the
trainer drops groups staler than max_staleness), counted by reason (state, StepMetrics values
``dropped_groups`` / ``dropped_<reason>``, Prometheus) and logged with its group id, and the step
trains on the rest. A batch with nothing left is counted as skipped and still advances the policy
version by one, its weights unchanged (stored and pushed under the new version): one version per consumed
batch is what a scheduler waits for before its next step (with ``max_policy_lag = 0`` a step of nothing
but failed rewards would otherwise leave it waiting for a version that never comes).
Replay is sampled with the learner's policy version as ``current_policy_version``, so a table
with ``max_policy_lag = L`` never returns a group more than L versions behind the learner.
Prioritized replay: each group's loss is weighted by its draw's importance weight (SampleInfo),
and after each step the configured ``priority_signal`` of every trained group is sent back with
UpdatePriorities (before the next Sample, so a group the step found worthless is not drawn again).

Inference replicas (``replicas``: a fixed list of clients, or a ``temper.client.discovery.Replicas``
re-resolved before every push, so a replica added later gets the policy): each version is written to
``policy_dir`` (temper.inference.policy_store: what a replica starting late loads before SERVING) and
then pushed to every replica, tagged with this run's ``lineage``. Before each Sample the learner checks
every replica (``sync_replicas``): one behind the learner's version (it restarted, or missed a push)
gets the current weights; one serving another lineage, or a vocabulary larger than the learner's
model, is reported by address (log, ``LearnerState.replica_errors``) and never pushed to.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Collection
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from prometheus_client import Counter, Gauge

from temper.client.discovery import Replicas
from temper.client.sdk import InferenceClient, ReplayClient
from temper.inference import policy_store
from temper.inference.weights import chunks_from_tensors
from temper.learner import checkpoint
from temper.learner.batching import DROP_REASONS, DroppedGroup, batch_from_groups, screen_groups
from temper.learner.trainer import Trainer
from temper.runtime import kafka
from temper.runtime.errors import InvalidArgument, require
from temper.runtime.logs import get_logger
from temper.runtime.storage import Mirror, StorageError
from temper.runtime.tracing import links_to, tracer
from temper.v1 import common_pb2, inference_pb2, replay_pb2

_log = get_logger(component="learner-loop")

STEP_VALUE = Gauge("temper_learner_step_value", "Learner metrics of the last step (loss, kl_ref, entropy, "
                   "clip_fraction, grad_norm, lr, advantage_mean, tokens_per_second, ...)", ["name"])
STEP = Gauge("temper_learner_step", "Learner updates applied")
POLICY_VERSION = Gauge("temper_learner_policy_version", "Version of the learner's current weights")
STEPS = Counter("temper_learner_steps", "Learner updates applied by this process")
TOKENS = Counter("temper_learner_tokens", "Completion tokens trained on")
CONSUMED_MEMORY = 100_000  # draws remembered (a redelivery comes within a lease or a replay restart of its draw)
CONSUMED_FILE = "consumed_draws.json"  # in each checkpoint: the draws consumed up to it
LEASES_LOST = Counter("temper_learner_replay_leases_lost", "Replay leases this learner could not settle (ran out "
                      "before the step ended: replay gave the batch back, so it may be trained on again)")
SKIPPED = Counter("temper_learner_skipped_batches",
                  "Batches, and malformed groups of a batch, refused (never trained on), by field", ["field"])
PUSH_FAILURES = Counter("temper_learner_weight_push_failures", "Weight pushes an inference replica refused")
PUSHES = Counter("temper_learner_weight_pushes", "Weight pushes a replica installed, by how they went: by_reference "
                 "(read from the shared policy_dir) or streamed (every byte over gRPC)", ["mode"])
CHECKPOINTS = Counter("temper_learner_checkpoints", "Checkpoints written")
PRIORITY_UPDATES = Counter("temper_learner_priority_updates", "Group priorities replay accepted from this learner")
DROPPED = Counter("temper_learner_dropped_groups", "Groups left out of a batch (the rest trained on), by reason",
                  ["reason"])
UPLOAD_FAILURES = Counter("temper_learner_checkpoint_upload_failures", "Periodic checkpoints not uploaded to checkpoint_url")


@dataclass
class LearnerState:
    step: int = 0
    policy_version: int = 0
    paused: bool = False
    skipped_batches: int = 0
    skipped_by_field: dict[str, int] = field(default_factory=dict)
    stale_groups_dropped: int = 0
    dropped_groups: int = 0  # every reason, stale included
    dropped_by_reason: dict[str, int] = field(default_factory=dict)
    push_failures: int = 0
    pushes_by_reference: int = 0  # installed from the shared policy_dir (UpdateWeightsRequest.stored_id)
    pushes_streamed: int = 0  # installed from chunks streamed over gRPC
    checkpoint_step: int = -1  # -1: none yet
    checkpoint_path: str = ""
    resumed: bool = False
    replica_errors: dict[str, str] = field(default_factory=dict)  # address -> why it is not pushed to
    replica_syncs: int = 0  # pushes to a replica found behind the learner (restarted, or missed a push)
    last: common_pb2.StepMetrics = field(default_factory=common_pb2.StepMetrics)


def replay_draw_values(info: list[replay_pb2.SampleInfo] | None, no_signal: Collection[str] = ()) -> dict[str, float]:
    """StepMetrics values describing replay's draws of the groups a step trained on: mean and min
    importance weight (1 for FIFO/uniform tables; < 1 where priorities differ), mean times sampled
    (this draw included; > 1: experience reuse), ``replay_reused_draws``: draws of groups drawn in an
    earlier step already (their fewest times sampled in this batch is > 1), and of those
    ``replay_reused_no_signal_draws``: groups in ``no_signal`` (all advantages 0), which priorities
    from ``mean_abs_advantage`` keep from being drawn again. Empty without SampleInfo."""
    if not info:
        return {}
    weights = [d.importance_weight for d in info]
    first: dict[str, int] = {}  # group -> its fewest times sampled among this batch's draws
    for d in info:
        first[d.group_id] = min(first.get(d.group_id, d.times_sampled), d.times_sampled)
    reused = [d.group_id for d in info if first[d.group_id] > 1]
    return {"replay_importance_weight_mean": sum(weights) / len(weights),
            "replay_importance_weight_min": min(weights),
            "replay_times_sampled_mean": sum(d.times_sampled for d in info) / len(info),
            "replay_reused_draws": float(len(reused)),
            "replay_reused_no_signal_draws": float(sum(1 for g in reused if g in no_signal))}


class LearnerLoop:
    def __init__(self, trainer: Trainer, replay: ReplayClient, replicas: list[InferenceClient] | Replicas,
                 producer: kafka.ProtoProducer | None, groups_per_step: int, table: str = "default",
                 sample_timeout_ms: int = 5_000, checkpoint_dir: str | Path | None = None,
                 checkpoint_every: int = 0, keep_checkpoints: int = 3, priority_signal: str = "none",
                 model_dir: str | Path | None = None, mirror: Mirror | None = None,
                 policy_dir: str | Path | None = None, sample_lease_s: float = 0.0):
        self.trainer = trainer
        self.model_dir = model_dir  # the folder the policy started from (config, tokenizer of exports)
        self.replay = replay
        self.replicas = replicas
        self.producer = producer
        self.groups_per_step = groups_per_step
        self.table = table
        self.sample_timeout_ms = sample_timeout_ms
        self.sample_lease_s = sample_lease_s  # > 0: batches are leased from replay, acknowledged after their step
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.checkpoint_every = checkpoint_every
        self.keep_checkpoints = keep_checkpoints
        self.priority_signal = priority_signal  # sent to replay as each group's priority after a step
        self.mirror = mirror  # object storage that every checkpoint is uploaded to (runtime.storage)
        self.policy_dir = Path(policy_dir) if policy_dir else None
        # stores each version, its file allocated while the previous step trained
        self._writer = policy_store.Writer(self.policy_dir) if self.policy_dir is not None else None
        self.lineage = uuid.uuid4().hex[:16]  # this run's versions; a resumed checkpoint brings its own
        self._stored: tuple[int, str] | None = None  # (version, stored_id) of the newest version in policy_dir
        self._stream_to: set[str] = set()  # replicas that do not read policy_dir: streamed the chunks
        self.state = LearnerState()
        self._lock = threading.Lock()  # one step / checkpoint at a time
        self._pending: tuple[list[common_pb2.RolloutGroup], list[replay_pb2.SampleInfo]] | None = None
        # (group id, times sampled) of each draw consumed -> the step that consumed it (module docstring)
        self._consumed: OrderedDict[tuple[str, int], int] = OrderedDict()
        self._stop = threading.Event()
        self._resume = threading.Event()
        self._resume.set()
        self._thread = threading.Thread(target=self._run, name="learner-loop", daemon=True)
        self._tracer = tracer("temper.learner")
        self.failed: BaseException | None = None  # what ended the loop, if anything did (the service's health)
        self.on_failure = None  # called with it (the service: a learner over ranks exits, see service.py)

    def alive(self) -> bool:
        """The loop is training, or paused, or stopped on request -- not ended by an error."""
        return self.failed is None

    def start(self) -> LearnerLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._resume.set()
        self._thread.join(30)
        if self._writer is not None:
            self._writer.close()  # the spare file allocated for the next version

    def _run(self) -> None:
        try:
            self._train()
        except BaseException as e:  # the batch in hand went back to replay (requeued) on the way out
            self.failed = e
            _log.exception("learner loop ended by an error")
            if self.on_failure is not None:
                self.on_failure(e)
            raise

    def _train(self) -> None:
        self._requeue_left_behind()
        while not self._stop.is_set():
            self._resume.wait()
            if self._stop.is_set():
                return
            t0 = time.perf_counter()
            sampled, self._pending = self._pending, None
            try:
                with self._lock:
                    self.sync_replicas()
            except Exception:  # noqa: BLE001 - resolving or a replica failing never stops training
                _log.exception("replica sync failed")
            lease = ""
            if sampled is None:
                try:
                    r = self.replay.sample_batch(self.groups_per_step, self.table, self.sample_timeout_ms,
                                               current_policy_version=self.trainer.policy_version,
                                               lease_ms=int(self.sample_lease_s * 1000))
                    sampled, lease = (list(r.groups), list(r.info)), r.lease_id
                    self._hold(lease)
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                        _log.warning("sample failed", code=e.code().name, details=e.details())
                        self._stop.wait(1.0)
                    continue
            with self._lock:
                if not self._resume.is_set() or self._stop.is_set():  # paused while sampling: keep the batch
                    if lease:  # replay keeps it: given back now, drawn again after resume
                        self._settle(lease, "requeue")
                    else:
                        self._pending = sampled
                    continue
                with self._lease_renewed(lease):
                    try:
                        self._step(*sampled, t0)
                    except BaseException:
                        self._settle(lease, "requeue")
                        raise
                self._settle(lease, "ack")

    # -- replay leases --------------------------------------------------------------------------
    @contextmanager
    def _lease_renewed(self, lease: str):
        """While the block runs, extend ``lease`` every third of its length (a slow step keeps its batch)."""
        if not lease:
            yield
            return
        done = threading.Event()

        def renew():
            while not done.wait(self.sample_lease_s / 3):
                try:
                    self.replay.ack_sample(lease, "extend", int(self.sample_lease_s * 1000))
                except grpc.RpcError as e:
                    _log.warning("replay lease not extended", lease_id=lease, code=e.code().name, details=e.details())

        renewer = threading.Thread(target=renew, name="learner-lease", daemon=True)
        renewer.start()
        try:
            yield
        finally:
            done.set()
            renewer.join()

    def _settle(self, lease: str, action: str) -> None:
        if not lease:
            return
        try:
            self.replay.ack_sample(lease, action)
        except grpc.RpcError as e:  # NOT_FOUND: it ran out and replay gave the batch back (it may train again)
            LEASES_LOST.inc()
            _log.warning("replay lease not settled", lease_id=lease, action=action, code=e.code().name,
                         details=e.details())
        self._hold("")

    # The lease of the batch in hand, in the checkpoint folder while the batch is trained: a learner killed
    # between its step and the ack (after its push, before its checkpoint) leaves it there, and its successor
    # gives that batch back to replay at once instead of waiting for the lease to run out -- it is drawn
    # again and trained if the successor's checkpoint predates it, dropped as a duplicate if not.
    def _lease_file(self) -> Path | None:
        return self.checkpoint_dir / "lease-in-hand" if self.checkpoint_dir is not None else None

    def _hold(self, lease: str) -> None:
        path = self._lease_file()
        if path is None:
            return
        try:
            if lease:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(lease)
                os.replace(tmp, path)
            else:
                path.unlink(missing_ok=True)
        except OSError as e:  # the lease then runs out by itself, as without this file
            _log.warning("lease in hand not recorded", error=str(e))

    def _requeue_left_behind(self) -> None:
        path = self._lease_file()
        try:
            lease = path.read_text().strip() if path is not None and path.exists() else ""
        except OSError:
            lease = ""
        if not lease:
            return
        try:
            self.replay.ack_sample(lease, "requeue")
            _log.info("gave back the batch a killed predecessor held", lease_id=lease)
        except grpc.RpcError as e:  # NOT_FOUND: already settled, or it ran out and went back by itself
            _log.info("predecessor's lease already settled", lease_id=lease, code=e.code().name)
        self._hold("")

    # -- one step ------------------------------------------------------------------------------
    def train_on(self, groups: list[common_pb2.RolloutGroup], t0: float | None = None,
                 info: list[replay_pb2.SampleInfo] | None = None) -> common_pb2.StepMetrics | None:
        """One update on ``groups`` (None if the batch was refused; the refusal is counted)."""
        with self._lock:
            return self._step(groups, info, time.perf_counter() if t0 is None else t0)

    def _step(self, groups: list[common_pb2.RolloutGroup], info: list[replay_pb2.SampleInfo] | None,
              t0: float) -> common_pb2.StepMetrics | None:
        """``info``: replay's SampleInfo of each group's draw (its importance weight becomes the group's
        loss weight), or None (every weight 1)."""
        seen = {i for i, d in enumerate(info or []) if (d.group_id, d.times_sampled) in self._consumed}
        if seen:  # drawn again after a lost acknowledgement: consumed already (module docstring)
            self._count_reason("duplicate", len(seen))
            _log.warning("draws consumed already dropped", group_ids=sorted(info[i].group_id for i in seen))
            groups = [g for i, g in enumerate(groups) if i not in seen]
            info = [d for i, d in enumerate(info) if i not in seen]
            if not groups:
                return None
        duplicates = len(seen)
        weights = None if info is None else [i.importance_weight for i in info]
        # a step trains on many groups, each from its own scheduler-step trace: link to every one
        with self._tracer.start_as_current_span("learner.step", links=links_to(g.trace_context for g in groups),
                                                 attributes={"temper.groups": len(groups)}) as span:
            step_tokens = self.trainer.step_tokens  # set when the advantage estimator reads step rewards
            kept, dropped = screen_groups(groups, self.trainer.max_sequence_tokens, steps=step_tokens is not None,
                                          adapters=self.trainer.adapters)
            self._count_drops(dropped)
            stale = 0
            try:
                require(len(kept) > 0, "groups", f"nothing to train on: {len(groups)} sampled, {len(dropped)} dropped")
                dropped_at = {d.index for d in dropped}
                kept_weights = None if weights is None else [w for i, w in enumerate(weights) if i not in dropped_at]
                kept_info = None if info is None else [d for i, d in enumerate(info) if i not in dropped_at]
                batch = batch_from_groups(kept, kept_weights, step_tokens)
                # stale groups leave here, so the step's metrics (samples, rewards) describe what trained
                try:
                    batch, stale = self.trainer.drop_stale(batch)
                except InvalidArgument:  # every group too stale: all counted as dropped, then refused
                    self._count_reason("stale", len(kept))
                    stale = len(kept)
                    raise
                if stale:
                    self._count_reason("stale", stale)
                values = self.trainer.step(batch)
            except InvalidArgument as e:
                self._count_skip(e)
                self._remember(info)
                if groups:  # a consumed batch: one version, as a trained one (module docstring)
                    drops = {f"dropped_{r}": float(n) for r, n in self._step_drops(dropped).items()}
                    drops.update(dropped_stale=float(stale), dropped_duplicate=float(duplicates))
                    self._advance_unchanged(groups[0].job_id, len(groups) + duplicates, drops, e)
                return None
            self._remember(info)  # before the checkpoint below: a learner resumed from it skips these draws
            values["stale_groups_dropped"] = float(stale)
            values.update({f"dropped_{r}": float(n) for r, n in self._step_drops(dropped).items()})
            values["dropped_stale"] = float(stale)
            values["dropped_duplicate"] = float(duplicates)
            values["dropped_groups"] = float(len(dropped) + stale + duplicates)
            span.set_attribute("temper.dropped_groups", len(dropped) + stale)
            if kept_info:  # the draws of the groups trained on (stale ones left out)
                trained = set(batch.group_ids or [])
                signal = self.trainer.group_signals.get("mean_abs_advantage", {})
                values.update(replay_draw_values([d for d in kept_info if d.group_id in trained],
                                                 {g for g, v in signal.items() if v == 0}))
            values["priorities_updated"] = float(self._send_priorities())
            version = self.trainer.policy_version
            self._push(version)
            domain_rewards: dict[str, list[float]] = {}
            for d, r in zip(batch.domains, batch.rewards.tolist()):
                domain_rewards.setdefault(d, []).append(r)
            metrics = common_pb2.StepMetrics(
                job_id=batch.job_id, step=self.trainer.step_count, policy_version=version,
                mean_reward=batch.rewards.mean().item(), samples=len(batch.rewards),
                seconds=time.perf_counter() - t0, values=values,
                domain_mean_reward={d: sum(v) / len(v) for d, v in domain_rewards.items()},
                mean_sample_policy_version=batch.policy_versions.float().mean().item(),
                min_sample_policy_version=int(batch.policy_versions.min()),
                max_sample_policy_version=int(batch.policy_versions.max()), group_ids=sorted(set(batch.group_ids or [])))
            span.set_attribute("temper.policy_version", version)
            if self.producer is not None:
                self.producer.send(kafka.METRICS, batch.job_id or "learner", metrics).get(30)
            if self.checkpoint_every > 0 and self.checkpoint_dir and self.trainer.step_count % self.checkpoint_every == 0:
                try:
                    self._checkpoint(None)
                except StorageError as e:  # written locally; the next checkpoint uploads again. Training goes on
                    UPLOAD_FAILURES.inc()
                    _log.error("checkpoint upload failed", step=self.trainer.step_count, error=str(e))
            s = self.state
            s.step, s.policy_version, s.last = self.trainer.step_count, version, metrics
            s.stale_groups_dropped += stale
            self._export(values)
            _log.info("step", step=s.step, mean_reward=round(metrics.mean_reward, 4), loss=round(values["loss"], 4))
            return metrics

    def _advance_unchanged(self, job_id: str, groups: int, drops: dict[str, float], why: InvalidArgument) -> None:
        """The next policy version with the current weights: stored and pushed like a step's, no update. Its
        StepMetrics has ``samples`` 0 and ``skipped_batch`` 1 (the trainer's step count unchanged), so a
        follower counting one record per consumed batch sees it; the monitor leaves it off the curves."""
        self.trainer.policy_version += 1
        version = self.trainer.policy_version
        self._push(version)
        self.state.policy_version = version
        POLICY_VERSION.set(version)
        _log.warning("batch trained nothing: policy version advanced, weights unchanged", policy_version=version,
                     step=self.trainer.step_count, groups=groups, why=str(why))
        if self.producer is not None:
            metrics = common_pb2.StepMetrics(job_id=job_id, step=self.trainer.step_count, policy_version=version,
                                             samples=0, values={"skipped_batch": 1.0, "dropped_groups": float(groups),
                                                                **drops})
            self.producer.send(kafka.METRICS, job_id or "learner", metrics).get(30)

    def _remember(self, info: list[replay_pb2.SampleInfo] | None) -> None:
        """Record the draws of a consumed batch (trained on or dropped by rule), the newest CONSUMED_MEMORY."""
        for d in info or []:
            self._consumed[(d.group_id, d.times_sampled)] = self.trainer.step_count
        while len(self._consumed) > CONSUMED_MEMORY:
            self._consumed.popitem(last=False)

    def _send_priorities(self) -> int:
        """The step's per-group signal as the groups' new priorities; returns how many replay
        updated (groups sampled out are reported unknown by replay, which is fine). A failure is
        logged, never fatal to training."""
        if self.priority_signal == "none":
            return 0
        priorities = self.trainer.group_signals.get(self.priority_signal, {})
        if not priorities:
            return 0
        try:
            r = self.replay.update_priorities(priorities, self.table)
        except grpc.RpcError as e:
            _log.warning("priority update failed", code=e.code().name, details=e.details())
            return 0
        PRIORITY_UPDATES.inc(r.updated)
        return r.updated

    @staticmethod
    def _step_drops(dropped: list[DroppedGroup]) -> dict[str, int]:
        counts = dict.fromkeys(DROP_REASONS, 0)
        for d in dropped:
            counts[d.reason] += 1
        return counts

    def _count_reason(self, reason: str, n: int = 1) -> None:
        s = self.state
        s.dropped_groups += n
        s.dropped_by_reason[reason] = s.dropped_by_reason.get(reason, 0) + n
        DROPPED.labels(reason).inc(n)

    def _count_drops(self, dropped: list[DroppedGroup]) -> None:
        for d in dropped:
            self._count_reason(d.reason)
            if d.reason == "invalid":  # a malformed group is refused naming its field, as a whole batch was
                kind = re.sub(r"\[\d+\]", "[]", d.field)
                self.state.skipped_by_field[kind] = self.state.skipped_by_field.get(kind, 0) + 1
                SKIPPED.labels(kind).inc()
            _log.warning("group dropped", group_id=d.group_id, reason=d.reason, field=d.field, detail=d.detail)

    def _count_skip(self, e: InvalidArgument) -> None:
        s = self.state
        s.skipped_batches += 1
        kind = re.sub(r"\[\d+\]", "[]", e.field or "batch")  # bounded label values for Prometheus
        s.skipped_by_field[kind] = s.skipped_by_field.get(kind, 0) + 1
        SKIPPED.labels(kind).inc()
        _log.error("batch skipped", error=str(e), field=e.field, skipped=s.skipped_batches)

    def _export(self, values: dict[str, float]) -> None:
        for name, value in values.items():
            STEP_VALUE.labels(name).set(value)
        STEP.set(self.trainer.step_count)
        POLICY_VERSION.set(self.trainer.policy_version)
        STEPS.inc()
        TOKENS.inc(values.get("tokens", 0.0))

    def current_replicas(self) -> list[InferenceClient]:
        """The inference replicas now (re-resolved when they come from a resolver)."""
        if isinstance(self.replicas, Replicas):
            return list(self.replicas.current(refresh=True).values())
        return list(self.replicas)

    def _push(self, version: int, replicas: list[InferenceClient] | None = None, store: bool = True) -> None:
        """Store the current weights as ``version`` (policy_dir; ``store``), then send them to ``replicas``
        (default: every replica, re-resolved); a refusal is logged and counted.

        A replica that reads the same policy_dir (``reads_stored_updates``; the local launcher gives both
        services one folder) gets the version by reference (``stored_id``): it reads the file just stored
        instead of receiving every byte over gRPC. One that does not find it there (its policy_dir is another
        folder: another host) is streamed the chunks, now and from then on."""
        weights = None
        if self._writer is not None and store:  # first: a replica starting now loads this version
            weights = self.trainer.push_weights()  # in the engine's dtype: bf16 halves the bytes sent
            stored_id = uuid.uuid4().hex
            self._writer.write(weights, version, self.lineage, stored_id)
            self._stored = (version, stored_id)
        replicas = self.current_replicas() if replicas is None else replicas
        replicas = [r for r in replicas if r.address not in self.state.replica_errors]
        if not replicas:
            return
        for replica in replicas:
            try:
                if self._push_stored(replica, version):
                    continue
                weights = self.trainer.push_weights() if weights is None else weights
                replica.update_weights(chunks_from_tensors(weights, new_version=version, lineage=self.lineage,
                                                           encoded=True))
                self.state.pushes_streamed += 1
                PUSHES.labels("streamed").inc()
            except grpc.RpcError as e:
                self.state.push_failures += 1
                PUSH_FAILURES.inc()
                _log.error("weight push failed", replica=replica.address, code=e.code().name, details=e.details())

    def _push_stored(self, replica: InferenceClient, version: int) -> bool:
        """Push ``version`` to ``replica`` by reference when it is stored and the replica may read it; False:
        stream it instead (not stored, or the replica does not read this learner's policy_dir -- then from now
        on -- or it failed reading the file with an internal error: then this version only)."""
        if self._stored is None or self._stored[0] != version or replica.address in self._stream_to:
            return False
        try:
            replica.update_weights([inference_pb2.UpdateWeightsRequest(
                stored_id=self._stored[1], new_version=version, lineage=self.lineage)])
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INTERNAL:  # the replica failed reading the file: the bytes still reach it
                _log.warning("update by reference failed on the replica; streaming this version",
                             replica=replica.address, version=version, why=e.details())
                return False
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION or not (e.details() or "").startswith("stored_id:"):
                raise
            self._stream_to.add(replica.address)
            _log.info("streaming weights to this replica: it does not read the learner's policy_dir",
                      replica=replica.address, why=e.details())
            return False
        self.state.pushes_by_reference += 1
        PUSHES.labels("by_reference").inc()
        return True

    def replica_problem(self, address: str, info) -> str:
        """Why the replica at ``address`` (its GetPolicyVersionResponse ``info``) must not get this learner's
        weights; "" when it may."""
        if info.lineage and info.lineage != self.lineage:
            return (f"inference replica {address} serves version {info.policy_version} of lineage {info.lineage}, "
                    f"not this learner's lineage {self.lineage} (another training run's replica)")
        if info.vocab_size > self.trainer.vocab_size:
            return (f"inference replica {address} serves a vocabulary of {info.vocab_size} tokens; the learner's "
                    f"model has {self.trainer.vocab_size} (another model: model {info.model!r})")
        return ""

    def sync_replicas(self) -> list[str]:
        """Check every replica (module docstring): push the current weights to each one behind the learner;
        record the ones that must not be pushed to. Returns the addresses pushed to. Caller holds the lock."""
        version = self.trainer.policy_version
        behind = []
        for replica in self.current_replicas():
            try:
                info = replica.info()
            except grpc.RpcError:  # down or still loading: it loads policy_dir when it starts, or is synced later
                continue
            problem = self.replica_problem(replica.address, info)
            if problem:
                if self.state.replica_errors.get(replica.address) != problem:
                    _log.error("inference replica refused", replica=replica.address, error=problem)
                self.state.replica_errors[replica.address] = problem
                continue
            self.state.replica_errors.pop(replica.address, None)
            if info.policy_version < version:
                behind.append(replica)
        if behind:
            _log.warning("inference replicas behind the learner: pushing the current version",
                         replicas=[r.address for r in behind], policy_version=version)
            self._push(version, behind, store=False)  # the store has this version already
            self.state.replica_syncs += len(behind)
        return [r.address for r in behind]

    # -- checkpoints ---------------------------------------------------------------------------
    def _checkpoint(self, path: str | None) -> Path:
        root = self.checkpoint_dir
        if root is None:
            raise InvalidArgument("this learner has no checkpoint_dir", field="path")
        step = self.trainer.step_count
        if path:
            require("\x00" not in path, "path", "must not contain a NUL character")
            target = (root / path).resolve()
            if not target.is_relative_to(root.resolve()):
                raise InvalidArgument(f"must name a directory inside the checkpoint dir {root}", field="path")
        else:
            target = root / f"step-{step:08d}"
            if target.exists() and checkpoint.version_of(target) != self.trainer.policy_version:
                # the same step under a later version (a batch that trained nothing advanced it): a folder of its own
                target = root / f"step-{step:08d}-v{self.trainer.policy_version:08d}"
            if checkpoint.latest(root) == target.resolve() and (target / "trainer.json").exists():
                return target  # this very state is already the latest checkpoint
        t0 = time.perf_counter()
        try:
            checkpoint.save(self.trainer, target)
        except OSError as e:
            if not path:  # our own folder: the server's fault (a full disk), not the caller's
                raise
            raise InvalidArgument(f"cannot write {target}: {e.strerror}", field="path") from None
        (target / "lineage").write_text(self.lineage)  # a learner resumed from it continues this lineage
        (target / CONSUMED_FILE).write_text(json.dumps([[g, n, st] for (g, n), st in self._consumed.items()]))
        checkpoint.mark_latest(root, target)
        checkpoint.prune(root, self.keep_checkpoints)
        if self.mirror is not None:  # a failed upload fails the checkpoint (StorageError), loudly
            self.mirror.push(target)
            self.mirror.prune(self.keep_checkpoints, prefix="step-")
        CHECKPOINTS.inc()
        self.state.checkpoint_step, self.state.checkpoint_path = step, str(target)
        _log.info("checkpoint", step=step, path=str(target), seconds=round(time.perf_counter() - t0, 3))
        return target

    def checkpoint(self, path: str | None = None) -> tuple[Path, int, int]:
        """Write a checkpoint between steps; returns (directory, step, policy version)."""
        with self._lock:
            return self._checkpoint(path), self.trainer.step_count, self.trainer.policy_version

    def resume_from_checkpoint(self) -> bool:
        """Restore the newest checkpoint under checkpoint_dir, if any, and serve its weights.

        Replicas that already serve a version >= the checkpoint's (updates after the checkpoint
        that died with the old process) get the restored weights under a newer version number,
        so versions only ever increase.
        """
        if self.checkpoint_dir is None:
            return False
        if self.mirror is not None:
            self._pull_latest()
        path = checkpoint.latest(self.checkpoint_dir)
        if path is None:
            return False
        with self._lock:
            meta = checkpoint.load(self.trainer, path)
            if (path / "lineage").exists():
                self.lineage = (path / "lineage").read_text().strip()
            self._consumed = OrderedDict(((g, n), st) for g, n, st in json.loads((path / CONSUMED_FILE).read_text())) \
                if (path / CONSUMED_FILE).exists() else OrderedDict()
            serving: list[tuple[InferenceClient, int]] = []
            for replica in self.current_replicas():
                try:
                    serving.append((replica, replica.policy_version()))
                except grpc.RpcError as e:  # it gets the weights with the next step's push
                    _log.warning("replica unreachable at resume", replica=replica.address, code=e.code().name)
            newest = max((v for _, v in serving), default=-1)
            if newest > self.trainer.policy_version:
                self.trainer.policy_version = newest + 1
            behind = [r for r, v in serving if v != self.trainer.policy_version]
            if behind or self.policy_dir is not None:
                self._push(self.trainer.policy_version, behind)
            s = self.state
            s.step, s.policy_version, s.resumed = self.trainer.step_count, self.trainer.policy_version, True
            s.checkpoint_step, s.checkpoint_path = int(meta["step"]), str(path)
            STEP.set(s.step)
            POLICY_VERSION.set(s.policy_version)
        _log.info("resumed", step=s.step, policy_version=s.policy_version, path=str(path))
        return True

    def export_policy(self, path: str, dtype: str = "") -> tuple[Path, int, int, int]:
        """The current policy as an HF folder at ``path`` (between steps); (path, step, version, bytes). ``dtype``
        "": the dtype the policy is pushed to inference in (``push_dtype``), i.e. the weights that were served and
        evaluated -- not the start folder's stored dtype, which may round a policy trained in fp32 at a small lr
        back to where it started."""
        from temper.learner.export import DTYPES, export_policy

        with self._lock:
            step, version = self.trainer.step_count, self.trainer.policy_version
            served = next(name for name, d in DTYPES.items() if d == self.trainer.push_dtype)
            size = export_policy({**self.trainer.base_weights(), **self.trainer.adapter_weights()}, self.model_dir, path,
                                 dtype or served,
                                 meta={"step": step, "policy_version": version})
        return Path(path), step, version, size

    def _pull_latest(self) -> None:
        """Make the object store's newest checkpoint the local latest if it is newer than the local one."""
        name = self.mirror.latest()
        if name is None:
            return
        local = checkpoint.latest(self.checkpoint_dir)
        if local is not None and local.name == name:
            return
        pulled = self.mirror.pull(name, self.checkpoint_dir)
        if local is None or checkpoint.step_of(pulled) > checkpoint.step_of(local):
            checkpoint.mark_latest(self.checkpoint_dir, pulled)
            _log.info("checkpoint fetched", url=f"{self.mirror.store.url}/{name}", path=str(pulled))

    # -- control -------------------------------------------------------------------------------
    def pause(self) -> None:
        """Stop taking steps; returns once any step in flight has finished."""
        self.state.paused = True
        self._resume.clear()
        with self._lock:
            pass

    def resume(self) -> None:
        self.state.paused = False
        self._resume.set()
