"""The monitor's core: durable curves and step series, detectors, alerts and their policies. No transport.

Scored groups and learner metrics come in (from the ``scored`` and ``metrics`` topics, at least
once); each is recorded once, keyed by ``group_id`` / (job, learner step), in a sqlite file, so
a restarted monitor has its curves, series and alerts back without re-reading the topics.

Steps: the groups of scheduler step s of a job are summed into per-domain statistics
(``temper.monitor.stats``) and the step *closes*, and the detectors run, as soon as all its
groups are in (``RolloutGroup.step_groups``, set by the scheduler; else the ``groups_per_step``
setting, if set), or else when the first group of a later step of that job arrives. A group
that arrives after its step closed moves the reward curve but no longer the closed step. A
learner step closes on arrival (domain ``*``).

Execution traces (the ``sandbox-traces`` topic) of code trajectories are recorded once per
execution id, with what their run showed (``stats.trace_flags``) and the trajectory ids they
carry (``ExecutionTrace.origin``). When a step closes, the traces of its groups add their tallies
to the step (``stats.trace_counts``); a trace that arrives after its group's step closed amends
that step's tallies and the detectors run again (the two topics are not ordered between them).
A trace with no origin (a direct caller of the sandbox) says nothing about a job and is ignored.

Alerts: a detector's finding becomes an Alert with its evidence, at most once per
(job, domain, detector) every ``cooldown_steps`` steps. It is written to the store (pending)
together with the message that raised it, then its policy acts (warn: nothing more; pause/stop:
the job, through ``act``), then it is published (``publish``) and marked done. Alerts still
pending after a crash are acted on and published at start-up (``flush_pending``).
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge

from temper.monitor import detectors as det
from temper.monitor import stats
from temper.runtime.errors import InvalidArgument, require
from temper.runtime.logs import get_logger
from temper.runtime.sqlite import open_sqlite
from temper.v1 import common_pb2, monitor_pb2, sandbox_pb2

_log = get_logger(component="monitor")

ALERTS = Counter("temper_monitor_alerts_total", "Alerts raised", ["detector", "severity", "action"])
SERIES = Gauge("temper_monitor_series", "Last closed step's value of a monitored series (live view)",
               ["job", "domain", "name"])
SERIES_EXPORTED = ("reward", "length", "heldout", "correctness", "format", "model", "repetition", "gibberish",
                   "kl_ref", "entropy", "clip_fraction", "approx_kl")

SEVERITY = {"info": monitor_pb2.ALERT_SEVERITY_INFO, "warning": monitor_pb2.ALERT_SEVERITY_WARNING,
            "critical": monitor_pb2.ALERT_SEVERITY_CRITICAL}
POLICY = {"warn": monitor_pb2.ALERT_ACTION_WARN, "pause": monitor_pb2.ALERT_ACTION_PAUSE,
          "stop": monitor_pb2.ALERT_ACTION_STOP}
DEFAULT_SEVERITY = {"reward_vs_gold": "critical", "rm_vs_verifier": "critical", "code_exploit": "critical",
                    "format_only": "warning", "length": "warning", "degeneration": "warning",
                    "training_signal": "warning", "reward_jump": "warning"}
SETTING_KEYS = {"enabled", "policy", "severity", "cooldown_steps", "domains"}
METRICS_DOMAIN = "*"
MAX_LIST = 10_000


@dataclass
class DetectorSettings:
    detector: det.Detector
    enabled: bool = True
    policy: str = "warn"
    severity: str = "warning"
    cooldown_steps: int = 20


class DetectorSet:
    """Detectors configured by the ``[monitor.detectors.<name>]`` tables.

    Each table may set ``enabled``, ``policy`` (warn | pause | stop), ``severity``
    (info | warning | critical), ``cooldown_steps`` and the detector's own parameters, and
    override any of them per domain in ``[monitor.detectors.<name>.domains."<prefix>"]``
    (``toy`` applies to ``toy.*``; the longest matching prefix wins). Every detector not named
    runs with its defaults (policy warn). Unknown names and keys are refused, the key named.
    """

    def __init__(self, table: dict[str, dict[str, Any]] | None = None):
        self.table = table or {}
        for name, entry in self.table.items():
            where = f"monitor.detectors.{name}"
            if name not in det.DETECTORS:
                raise InvalidArgument(f"unknown detector {name!r}; known: {sorted(det.DETECTORS)}", field=where)
            require(isinstance(entry, dict), where, "must be a table")
            for prefix, override in (entry.get("domains") or {}).items():
                require(isinstance(override, dict), f"{where}.domains.{prefix}", "must be a table")
                require("domains" not in override, f"{where}.domains.{prefix}.domains", "domains do not nest")
                self._settings(name, {**entry, **override}, f"{where}.domains.{prefix}")
            self._settings(name, entry, where)
        self._cache: dict[tuple[str, str], list[tuple[str, DetectorSettings]]] = {}

    @staticmethod
    def _settings(name: str, entry: dict, where: str) -> DetectorSettings:
        params = {k: v for k, v in entry.items() if k not in SETTING_KEYS}
        s = DetectorSettings(det.build(name, params, where), severity=DEFAULT_SEVERITY.get(name, "warning"))
        if "enabled" in entry:
            require(isinstance(entry["enabled"], bool), f"{where}.enabled", "must be true or false")
            s.enabled = entry["enabled"]
        if "policy" in entry:
            require(entry["policy"] in POLICY, f"{where}.policy",
                    f"must be one of {sorted(POLICY)}, got {entry['policy']!r}")
            s.policy = entry["policy"]
        if "severity" in entry:
            require(entry["severity"] in SEVERITY, f"{where}.severity",
                    f"must be one of {sorted(SEVERITY)}, got {entry['severity']!r}")
            s.severity = entry["severity"]
        if "cooldown_steps" in entry:
            c = entry["cooldown_steps"]
            require(isinstance(c, int) and not isinstance(c, bool) and c >= 1, f"{where}.cooldown_steps",
                    f"must be an integer >= 1, got {c!r}")
            s.cooldown_steps = c
        return s

    def for_domain(self, source: str, domain: str) -> list[tuple[str, DetectorSettings]]:
        key = (source, domain)
        if key not in self._cache:
            out = []
            for name, cls in det.DETECTORS.items():
                if cls.source != source:
                    continue
                entry = dict(self.table.get(name, {}))
                overrides = entry.pop("domains", None) or {}
                match = max((p for p in overrides if domain == p or domain.startswith(p + ".")), key=len, default=None)
                if match is not None:
                    entry.update(overrides[match])
                s = self._settings(name, entry, f"monitor.detectors.{name}")
                if s.enabled:
                    out.append((name, s))
            self._cache[key] = out
        return self._cache[key]

    def policies(self) -> set[str]:
        """Every policy some detector may apply (to check that pause/stop have a scheduler)."""
        found = set()
        for entry in self.table.values():
            for e in [entry, *[{**entry, **o} for o in (entry.get("domains") or {}).values()]]:
                found.add(e.get("policy", "warn"))
        return found or {"warn"}


@dataclass
class Series:
    steps: list[det.StepStats] = field(default_factory=list)


def _alert_matches(a: monitor_pb2.Alert, r: monitor_pb2.ListAlertsRequest) -> bool:
    return ((not r.job_id or a.job_id == r.job_id) and (not r.domain or a.domain == r.domain)
            and (not r.detector or a.detector == r.detector) and a.severity >= r.min_severity
            and a.unix_ms >= r.since_unix_ms)


class Monitor:
    """Thread-safe: the ``scored``, ``metrics`` and ``sandbox-traces`` consumers call in from their own threads."""

    def __init__(self, path: str | Path, detectors: DetectorSet | None = None, groups_per_step: int = 0,
                 act: Callable[[monitor_pb2.Alert, str], str] | None = None,
                 publish: Callable[[monitor_pb2.Alert], None] | None = None, clock: Callable[[], float] = time.time):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.detectors = detectors or DetectorSet()
        self.groups_per_step = groups_per_step
        self._act = act
        self._publish = publish
        self._clock = clock
        self._lock = threading.RLock()
        self._db = open_sqlite(path)  # durable: an offset is committed after a commit returns
        self._db.executescript("""
            CREATE TABLE IF NOT EXISTS groups (group_id TEXT PRIMARY KEY, job_id TEXT, domain TEXT, step INTEGER,
                                               summary TEXT, closed INTEGER);
            CREATE INDEX IF NOT EXISTS groups_open ON groups (closed, job_id, step);
            CREATE TABLE IF NOT EXISTS curve (domain TEXT, policy_version INTEGER, total REAL, n INTEGER,
                                              PRIMARY KEY (domain, policy_version));
            CREATE TABLE IF NOT EXISTS steps (job_id TEXT, source TEXT, domain TEXT, step INTEGER, stats TEXT,
                                              PRIMARY KEY (job_id, source, domain, step));
            CREATE TABLE IF NOT EXISTS traces (execution_id TEXT PRIMARY KEY, job_id TEXT, group_id TEXT,
                                               trajectory_ids TEXT, flags TEXT);
            CREATE INDEX IF NOT EXISTS traces_group ON traces (group_id);
            CREATE TABLE IF NOT EXISTS alerts (alert_id TEXT PRIMARY KEY, seq INTEGER, body BLOB, policy TEXT,
                                               pending INTEGER);
        """)
        self._series: dict[tuple[str, str, str], Series] = defaultdict(Series)
        self._open: dict[tuple[str, int], list[stats.GroupSummary]] = defaultdict(list)
        self._alerts: list[monitor_pb2.Alert] = []
        self._last_alert: dict[tuple[str, str, str], int] = {}
        # alerts being acted on / published right now by some thread: the other consumer's
        # flush_pending must not dispatch them a second time
        self._inflight: set[str] = set()
        self._load()

    # -- restart -------------------------------------------------------------------------------
    def _load(self) -> None:
        for job, source, domain, step, text in self._db.execute(
                "SELECT job_id, source, domain, step, stats FROM steps ORDER BY step"):
            raw = json.loads(text)
            self._series[(job, source, domain)].steps.append(
                det.StepStats(step, raw["samples"], raw["values"], raw["examples"]))
        for gid, job, domain, step, text in self._db.execute(
                "SELECT group_id, job_id, domain, step, summary FROM groups WHERE closed = 0"):
            self._open[(job, step)].append(stats.GroupSummary.from_json(gid, job, domain, step, text))
        for (body,) in self._db.execute("SELECT body FROM alerts ORDER BY seq"):
            a = monitor_pb2.Alert.FromString(body)
            self._alerts.append(a)
            self._last_alert[(a.job_id, a.domain, a.detector)] = a.step

    def flush_pending(self) -> int:
        """Act on and publish the alerts a crash left pending; returns how many."""
        with self._lock:
            rows = [(monitor_pb2.Alert.FromString(body), policy) for body, policy in
                    self._db.execute("SELECT body, policy FROM alerts WHERE pending = 1 ORDER BY seq")]
            rows = [(a, p) for a, p in rows if a.alert_id not in self._inflight]
            self._inflight.update(a.alert_id for a, _ in rows)
        self._dispatch_all(rows)
        return len(rows)

    def _flush_if_pending(self) -> None:
        # a publish that failed raised out of the handler: its message comes again (and is now a
        # duplicate), so the alert it left pending goes out first
        with self._lock:
            pending = [a for (a,) in self._db.execute("SELECT alert_id FROM alerts WHERE pending = 1")
                       if a not in self._inflight]
        if pending:
            self.flush_pending()

    @contextmanager
    def _transaction(self):
        """One write transaction (the caller holds the lock); yields the list the body collects its raised
        alerts in. On any error: rolled back, those alerts no longer in flight, the in-memory state reloaded."""
        raised: list[tuple[monitor_pb2.Alert, str]] = []
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield raised
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            self._inflight.difference_update(a.alert_id for a, _ in raised)
            self._reload_after_rollback()
            raise

    # -- input ---------------------------------------------------------------------------------
    def add_scored(self, group: common_pb2.RolloutGroup) -> list[monitor_pb2.Alert]:
        """Record ``group`` once; close the steps it completes and return the alerts they raised."""
        require(bool(group.group_id), "group_id", "must be set")
        require(bool(group.job_id), "job_id", "must be set")
        require(group.step >= 0, "step", f"must be >= 0, got {group.step}")
        summary = stats.summarize(group)
        self._flush_if_pending()
        with self._lock:
            if self._db.execute("SELECT 1 FROM groups WHERE group_id = ?", (group.group_id,)).fetchone():
                return []
            with self._transaction() as raised:
                closed = self._db.execute("SELECT 1 FROM steps WHERE job_id = ? AND source = 'scored' AND step = ? "
                                          "LIMIT 1", (group.job_id, group.step)).fetchone() is not None
                self._db.execute("INSERT INTO groups VALUES (?, ?, ?, ?, ?, ?)",
                                 (group.group_id, group.job_id, group.task.domain, group.step, summary.to_json(),
                                  int(closed)))
                for t in group.trajectories:
                    if t.reward.status == common_pb2.REWARD_STATUS_OK:
                        self._db.execute("INSERT INTO curve VALUES (?, ?, ?, 1) ON CONFLICT (domain, policy_version) "
                                         "DO UPDATE SET total = total + excluded.total, n = n + 1",
                                         (group.task.domain, t.policy_version, t.reward.total))
                if not closed:
                    self._open[(group.job_id, group.step)].append(summary)
                    due = sorted(s for (j, s) in self._open if j == group.job_id and s < group.step)
                    expected = group.step_groups or self.groups_per_step
                    if expected and len(self._open[(group.job_id, group.step)]) >= expected:
                        due.append(group.step)
                    for step in due:
                        raised += self._close(group.job_id, step)
        self._dispatch_all(raised)
        return [a for a, _ in raised]

    def add_metrics(self, m: common_pb2.StepMetrics) -> list[monitor_pb2.Alert]:
        """Record one learner step once (job-wide series, domain ``*``) and run the metrics detectors."""
        require(bool(m.job_id), "job_id", "must be set")
        if m.samples == 0 and m.values.get("skipped_batch"):
            return []  # a batch that trained nothing (the learner dropped every group): no point of a curve
        require(m.step >= 1, "step", f"must be >= 1, got {m.step}")
        self._flush_if_pending()
        with self._lock:
            if self._db.execute("SELECT 1 FROM steps WHERE job_id = ? AND source = 'metrics' AND step = ?",
                                (m.job_id, m.step)).fetchone():
                return []
            with self._transaction() as raised:
                raised += self._append(m.job_id, "metrics", METRICS_DOMAIN, stats.from_metrics(m))
        self._dispatch_all(raised)
        return [a for a, _ in raised]

    def add_trace(self, trace: sandbox_pb2.ExecutionTrace) -> list[monitor_pb2.Alert]:
        """Record one execution trace once (by execution id); amend its step if that closed already."""
        origin = trace.origin
        if not origin.job_id or not origin.group_id or not origin.trajectory_ids:
            return []  # not from a job's reward run: nothing to join
        require(bool(trace.execution_id), "execution_id", "must be set")
        require(trace.method in ("Execute", "RunTests"), "method", f"must be Execute or RunTests, got {trace.method!r}")
        require(trace.method != "RunTests" or trace.HasField("run_tests_request"), "run_tests_request",
                "a RunTests trace carries its request")
        if trace.verdict == sandbox_pb2.VERDICT_SANDBOX_ERROR:
            return []  # the sandbox failed, not the program: it shows nothing (the run is retried)
        flags = sorted(stats.trace_flags(trace))
        self._flush_if_pending()
        with self._lock:
            if self._db.execute("SELECT 1 FROM traces WHERE execution_id = ?", (trace.execution_id,)).fetchone():
                return []
            with self._transaction() as raised:
                self._db.execute("INSERT INTO traces VALUES (?, ?, ?, ?, ?)",
                                 (trace.execution_id, origin.job_id, origin.group_id,
                                  json.dumps(list(origin.trajectory_ids)), json.dumps(flags)))
                row = self._db.execute("SELECT job_id, domain, step, closed FROM groups WHERE group_id = ?",
                                       (origin.group_id,)).fetchone()
                if row is not None and row[3]:
                    raised += self._amend(row[0], row[1], row[2])
        self._dispatch_all(raised)
        return [a for a, _ in raised]

    def _traced(self, job: str, domain: str, step: int) -> tuple[dict[str, float], list[str]]:
        """The trace tallies of the groups of (job, domain, step): each traced trajectory once, its flags
        the union over its traces (a group scored again is traced again)."""
        by_tid: dict[str, set[str]] = {}
        for ids, flags in self._db.execute(
                "SELECT t.trajectory_ids, t.flags FROM traces t JOIN groups g ON t.group_id = g.group_id "
                "WHERE g.job_id = ? AND g.domain = ? AND g.step = ? ORDER BY t.rowid", (job, domain, step)):
            for tid in json.loads(ids):
                by_tid.setdefault(tid, set()).update(json.loads(flags))
        return stats.trace_counts(list(by_tid.items()))

    @staticmethod
    def _with_traces(s: det.StepStats, counts: dict[str, float], flagged: list[str]) -> None:
        for k in [k for k in s.values if k == "code.traced" or k.startswith("code.observed")]:
            del s.values[k]
        if counts.get("code.traced"):
            s.values.update(counts)
        if flagged:
            s.examples["code_observed"] = flagged[:stats.EXAMPLES_PER_KEY * 2]
        else:
            s.examples.pop("code_observed", None)

    def _amend(self, job: str, domain: str, step: int) -> list[tuple[monitor_pb2.Alert, str]]:
        """A trace came in after its step closed: the step's trace tallies again, then the detectors."""
        series = self._series.get((job, "scored", domain))
        found = [s for s in (series.steps if series else []) if s.step == step]
        if not found:
            return []
        s = found[0]
        self._with_traces(s, *self._traced(job, domain, step))
        self._db.execute("UPDATE steps SET stats = ? WHERE job_id = ? AND source = 'scored' AND domain = ? AND step = ?",
                         (json.dumps({"samples": s.samples, "values": s.values, "examples": s.examples}),
                          job, domain, step))
        return self._detect(job, "scored", domain)

    def _reload_after_rollback(self) -> None:
        self._series.clear()
        self._open.clear()
        self._alerts.clear()
        self._last_alert.clear()
        self._load()

    def _close(self, job: str, step: int) -> list[tuple[monitor_pb2.Alert, str]]:
        groups = self._open.pop((job, step), [])
        self._db.execute("UPDATE groups SET closed = 1 WHERE job_id = ? AND step = ?", (job, step))
        by_domain: dict[str, list[stats.GroupSummary]] = defaultdict(list)
        for g in groups:
            by_domain[g.domain].append(g)
        raised = []
        for domain in sorted(by_domain):
            s = stats.merge(step, by_domain[domain])
            self._with_traces(s, *self._traced(job, domain, step))
            raised += self._append(job, "scored", domain, s)
        return raised

    def _append(self, job: str, source: str, domain: str, s: det.StepStats) -> list[tuple[monitor_pb2.Alert, str]]:
        self._db.execute("INSERT INTO steps VALUES (?, ?, ?, ?, ?)", (job, source, domain, s.step, json.dumps(
            {"samples": s.samples, "values": s.values, "examples": s.examples})))
        series = self._series[(job, source, domain)]
        series.steps.append(s)
        for name in SERIES_EXPORTED:
            if name in s.values:
                SERIES.labels(job, domain, name).set(s.values[name])
        return self._detect(job, source, domain)

    def _detect(self, job: str, source: str, domain: str) -> list[tuple[monitor_pb2.Alert, str]]:
        """Run the detectors of (source, domain) on the series as it stands; the newest step is the alert's."""
        series = self._series[(job, source, domain)]
        s = series.steps[-1]
        raised = []
        for name, settings in self.detectors.for_domain(source, domain):
            last = self._last_alert.get((job, domain, name))
            if last is not None and s.step - last < settings.cooldown_steps:
                continue
            finding = settings.detector.check(series.steps)
            if finding is None:
                continue
            alert = self._alert(job, domain, name, s.step, settings, finding)
            self._db.execute("INSERT OR IGNORE INTO alerts VALUES (?, ?, ?, ?, 1)",
                             (alert.alert_id, len(self._alerts), alert.SerializeToString(), settings.policy))
            self._alerts.append(alert)
            self._inflight.add(alert.alert_id)
            self._last_alert[(job, domain, name)] = s.step
            raised.append((alert, settings.policy))
        return raised

    def _alert(self, job, domain, name, step, settings: DetectorSettings, f: det.Finding) -> monitor_pb2.Alert:
        return monitor_pb2.Alert(
            alert_id=f"{job}/{domain}/{name}/{step}", detector=name, message=f.message,
            unix_ms=int(self._clock() * 1000), job_id=job, domain=domain, step=step,
            severity=SEVERITY[settings.severity], action=POLICY[settings.policy],
            evidence=monitor_pb2.AlertEvidence(
                first_step=f.first_step, last_step=f.last_step, steps=f.steps,
                series=[monitor_pb2.EvidenceSeries(name=k, values=v) for k, v in f.series.items()],
                values=f.values, trajectory_ids=f.examples))

    # -- policy and publication ----------------------------------------------------------------
    def _dispatch_all(self, raised: list[tuple[monitor_pb2.Alert, str]]) -> None:
        try:
            for alert, policy in raised:
                self._dispatch(alert, policy)
        finally:  # those not reached after a failure stay pending, for the next flush
            with self._lock:
                self._inflight.difference_update(a.alert_id for a, _ in raised)

    def _dispatch(self, alert: monitor_pb2.Alert, policy: str) -> None:
        """Act on ``alert`` per ``policy``, publish it, mark it done. Raises if publishing fails
        (the caller's message is then redelivered and the pending alert flushed later)."""
        try:
            self._act_and_publish(alert, policy)
        finally:
            with self._lock:
                self._inflight.discard(alert.alert_id)

    def _act_and_publish(self, alert: monitor_pb2.Alert, policy: str) -> None:
        if policy != "warn" and not alert.action_result:
            try:
                alert.action_result = self._act(alert, policy) if self._act else "no scheduler configured"
            except Exception as e:  # noqa: BLE001 - the alert stands even if the job could not be acted on
                alert.action_result = f"{policy} failed: {type(e).__name__}: {e}"
                _log.error("alert action failed", alert_id=alert.alert_id, policy=policy, error=str(e))
        if self._publish is not None:
            self._publish(alert)
        with self._lock:
            self._db.execute("UPDATE alerts SET pending = 0, body = ? WHERE alert_id = ?",
                             (alert.SerializeToString(), alert.alert_id))
            for i, a in enumerate(self._alerts):
                if a.alert_id == alert.alert_id:
                    self._alerts[i] = alert
        sev = monitor_pb2.AlertSeverity.Name(alert.severity).removeprefix("ALERT_SEVERITY_").lower()
        ALERTS.labels(alert.detector, sev, policy).inc()
        _log.warning("alert", alert_id=alert.alert_id, detector=alert.detector, job_id=alert.job_id,
                     domain=alert.domain, step=alert.step, severity=sev, policy=policy, message=alert.message,
                     action_result=alert.action_result, trajectory_ids=list(alert.evidence.trajectory_ids))

    # -- queries -------------------------------------------------------------------------------
    def list_alerts(self, request: monitor_pb2.ListAlertsRequest) -> list[monitor_pb2.Alert]:
        require(0 <= request.limit <= MAX_LIST, "limit", f"must be in [0, {MAX_LIST}], got {request.limit}")
        require(request.since_unix_ms >= 0, "since_unix_ms", f"must be >= 0, got {request.since_unix_ms}")
        require(request.min_severity in monitor_pb2.AlertSeverity.values(), "min_severity",
                f"unknown severity {request.min_severity}")
        require(not request.detector or request.detector in det.DETECTORS, "detector",
                f"unknown detector {request.detector!r}; known: {sorted(det.DETECTORS)}")
        with self._lock:
            found = [a for a in self._alerts if _alert_matches(a, request)]
        return found[-(request.limit or 1000):]

    def points(self, domain: str = "") -> list[tuple[str, int, float, int]]:
        """Reward curve: (domain, policy_version, mean_reward, samples), by domain then version."""
        with self._lock:
            rows = self._db.execute("SELECT domain, policy_version, total, n FROM curve ORDER BY domain, policy_version")
            return [(d, v, t / n, n) for d, v, t, n in rows if n and (not domain or d == domain)]

    def steps(self, job: str, domain: str = "", last: int = 0) -> list[tuple[str, str, list[det.StepStats]]]:
        """(source, domain, the newest ``last`` closed steps, oldest first) of every series of ``job``
        (of ``domain`` only, if given), by source then domain; ``last`` 0: 100."""
        require(bool(job), "job_id", "must be set")
        require(0 <= last <= MAX_LIST, "last", f"must be in [0, {MAX_LIST}], got {last}")
        with self._lock:
            found = [(src, d, list(series.steps[-(last or 100):])) for (j, src, d), series in self._series.items()
                     if j == job and (not domain or d == domain) and series.steps]
        return sorted(found, key=lambda x: (x[0], x[1]))

    def series(self, job: str, domain: str, source: str = "scored") -> list[det.StepStats]:
        with self._lock:
            return list(self._series.get((job, source, domain), Series()).steps)

    def close(self) -> None:
        with self._lock:
            self._db.close()
