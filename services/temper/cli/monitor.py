"""`temper monitor`: a live terminal view of a running job, read from the services through the SDK.

Two halves, kept apart so that each is testable alone:

- :func:`gather` asks the services of a home (their addresses from its ``state.json``, as every
  command finds them) for one :class:`Snapshot`: the scheduler's JobStatus (steps, per-domain
  draws and pass rates, evaluations), the monitor's per-step series (``ListSteps``: per-domain
  reward and response length; the learner's metrics: step times and tokens for throughput) and
  alerts (``ListAlerts``), the learner's status (KL, entropy, clip fraction, policy lag) and the
  replay table's stats (size, and draws held by leases; summed over replay shards, each shard's size
  kept). A service that is not up, or does not answer, is recorded as such
  in ``Snapshot.services`` and its part of the view stays empty; gathering never raises for it.
- :func:`render` turns a snapshot into rich tables (``rich.live.Live`` redraws them every
  ``--interval`` seconds); :func:`to_json` into the one JSON object ``--json`` prints.

Figures and their units: rewards are means over a step's trajectories (the monitor's last closed
scheduler step of the domain; "recent" is the scheduler's window); length is completion tokens;
steps/min and tokens/s are over the last ``window`` learner steps (tokens trained per second of
step wall time, sample + train + push; "train tok/s" is the last step's own rate, forward and
backward passes only, every epoch); policy lag is in policy versions (the learner's last step:
the version it updated from minus the mean / oldest version that generated its batch).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import grpc

from temper.client.sdk import LearnerClient, MonitorClient, ReplayClient, SchedulerClient
from temper.runtime.launcher import State, pid_alive, service_of
from temper.v1 import monitor_pb2, scheduler_pb2

SERVICES = ("scheduler", "monitor", "learner", "replay")
SIGNALS = ("kl_ref", "approx_kl", "entropy", "clip_fraction", "loss", "grad_norm")
UP = "up"


@dataclass
class DomainView:
    domain: str
    step: int | None = None              # the monitor's last closed scheduler step of this domain
    reward: float | None = None          # its mean reward
    length: float | None = None          # its mean completion length, tokens
    samples: int | None = None
    recent_reward: float | None = None   # the scheduler's recent window (DomainStatus.mean_reward)
    pass_rate: float | None = None       # the scheduler's recent pass rate
    weight: float | None = None          # current draw probability
    accuracy: float | None = None        # held-out accuracy of the latest evaluation that has the domain
    adapter: str = ""                    # the LoRA adapter its groups train (job.adapters); "": the shared policy


@dataclass
class AlertView:
    alert_id: str
    step: int
    domain: str
    detector: str
    severity: str                        # info | warning | critical
    policy: str                          # warn | pause | stop: what the monitor did
    action_result: str
    message: str
    evidence: str                        # one line: window, compared values, example trajectories


@dataclass
class Snapshot:
    taken_unix: float
    home: str
    services: dict[str, str]             # name -> "up", "not running", "stopped", or the error of its call
    job: dict = field(default_factory=dict)       # JobStatus essentials; empty: no job known
    domains: list[DomainView] = field(default_factory=list)
    learner: dict = field(default_factory=dict)   # step, policy_version, paused, lag, signals
    throughput: dict = field(default_factory=dict)
    replay: dict = field(default_factory=dict)
    eval: dict = field(default_factory=dict)      # the latest evaluation: phase, policy_version, accuracy
    alerts: list[AlertView] = field(default_factory=list)


def _short(enum, value: int, prefix: str) -> str:
    return enum.Name(value).removeprefix(prefix).lower()


def evidence_summary(e: monitor_pb2.AlertEvidence, examples: int = 2) -> str:
    """The alert's evidence in one line: "steps 3-12; gold_rise=-0.01 proxy_rise=0.31; e.g. j/s12/p0/3"."""
    parts = [f"steps {e.first_step}-{e.last_step}" if e.steps or e.last_step else ""]
    if e.values:
        parts.append(" ".join(f"{k}={v:.3g}" for k, v in sorted(e.values.items())))
    elif e.series:
        parts.append("series " + ", ".join(s.name for s in e.series))
    if e.trajectory_ids:
        parts.append("e.g. " + ", ".join(e.trajectory_ids[:examples]))
    return "; ".join(p for p in parts if p)


def _alert_view(a: monitor_pb2.Alert) -> AlertView:
    return AlertView(alert_id=a.alert_id, step=a.step, domain=a.domain, detector=a.detector,
                     severity=_short(monitor_pb2.AlertSeverity, a.severity, "ALERT_SEVERITY_"),
                     policy=_short(monitor_pb2.AlertAction, a.action, "ALERT_ACTION_"),
                     action_result=a.action_result, message=a.message, evidence=evidence_summary(a.evidence))


def _call_error(e: grpc.RpcError) -> str:
    return f"{e.code().name}: {e.details()}"


def _pick_job(jobs: list[scheduler_pb2.JobStatus], job_id: str) -> scheduler_pb2.JobStatus | None:
    if job_id:
        return next((j for j in jobs if j.job_id == job_id), None)
    live = [j for j in jobs if j.state in (scheduler_pb2.JOB_STATE_RUNNING, scheduler_pb2.JOB_STATE_PAUSED)]
    return (live or jobs or [None])[-1]


def _job_dict(j: scheduler_pb2.JobStatus) -> dict:
    return {"job_id": j.job_id, "state": _short(scheduler_pb2.JobState, j.state, "JOB_STATE_"),
            "steps_done": j.steps_done, "steps": j.steps, "groups_published": j.groups_published,
            "groups_scored": j.groups_scored, "max_policy_lag": j.spec.max_policy_lag,
            "pause_reason": j.pause_reason, "error": j.error}


def _throughput(metrics: list[monitor_pb2.StepPoint], window: int) -> dict:
    recent = [p for p in metrics[-window:] if p.values.get("step_seconds", 0.0) > 0]
    if not recent:
        return {}
    seconds = sum(p.values["step_seconds"] for p in recent)
    return {"steps": len(recent), "steps_per_minute": 60.0 * len(recent) / seconds,
            "tokens_per_second": sum(p.values.get("tokens", 0.0) for p in recent) / seconds,
            "train_tokens_per_second": recent[-1].values.get("tokens_per_second", 0.0)}


def gather(state: State | None, job_id: str = "", table: str = "default", alerts: int = 5, window: int = 10,
           timeout: float = 5.0) -> Snapshot:
    """One snapshot of the job ``job_id`` (default: the scheduler's running job, else its last one) from the
    services recorded in ``state`` (None: nothing is up). Never raises for a service that is missing or fails."""
    services = {name: "not running" for name in SERVICES}
    # replicas of these services (replay shards: replay, replay-1, ...) are asked too
    services.update({n: "not running" for n in (state.services if state is not None else {})
                     if service_of(n) in SERVICES})
    addresses = {}
    for name in services:
        proc = state.services.get(name) if state is not None else None
        if proc is None:
            continue
        if proc.stopped:
            services[name] = "stopped"
        elif proc.failed:
            services[name] = f"failed: {proc.failed}"
        elif pid_alive(proc.pid):
            addresses[name] = proc.address
    snap = Snapshot(taken_unix=time.time(), home=state.home if state is not None else "", services=services)

    def ask(name: str, client_class, fn):
        if name not in addresses or services[name] not in (UP, "not running"):  # not up, or failed already
            return None
        try:
            with client_class(addresses[name], timeout=timeout) as c:
                out = fn(c)
            services[name] = UP
            return out
        except grpc.RpcError as e:
            services[name] = _call_error(e)
            return None

    jobs = ask("scheduler", SchedulerClient, lambda c: c.list_jobs())
    job = _pick_job(jobs, job_id) if jobs is not None else None
    job_id = job.job_id if job is not None else job_id
    if job is not None:
        snap.job = _job_dict(job)
    elif job_id:
        snap.job = {"job_id": job_id}
    series = ask("monitor", MonitorClient, lambda c: c.list_steps(job_id) if job_id else []) or []
    found = ask("monitor", MonitorClient, lambda c: c.list_alerts(job_id=job_id, limit=alerts)) if alerts else []
    snap.alerts = [_alert_view(a) for a in reversed(found or [])]  # newest first
    learner = ask("learner", LearnerClient, lambda c: c.status())
    shards = [n for n in services if service_of(n) == "replay"]  # one table over the shards: summed below
    shard_stats = [ask(n, ReplayClient, lambda c: c.stats(table)) for n in shards]

    scored = {s.domain: s.steps for s in series if s.source == "scored"}
    metrics = next((s.steps for s in series if s.source == "metrics"), [])
    latest_eval = job.evals[-1] if job is not None and job.evals else None
    names = list(job.spec.domains) + list(job.spec.eval.extra_domains) if job is not None else []
    names += sorted(d for d in scored if d not in names)
    status_of = {d.domain: d for d in job.domains} if job is not None else {}
    for d in names:
        v = DomainView(d)
        if scored.get(d):
            last = scored[d][-1]
            v.step, v.samples = last.step, last.samples
            v.reward, v.length = last.values.get("reward"), last.values.get("length")
        if d in status_of:
            s = status_of[d]
            v.recent_reward, v.pass_rate, v.weight, v.adapter = s.mean_reward, s.pass_rate, s.weight, s.adapter
        if latest_eval is not None and d in latest_eval.accuracy:
            v.accuracy = latest_eval.accuracy[d]
        snap.domains.append(v)
    if latest_eval is not None:
        snap.eval = {"phase": latest_eval.phase, "policy_version": latest_eval.policy_version,
                     "problems": latest_eval.problems, "accuracy": dict(latest_eval.accuracy)}

    if learner is not None:
        last = learner.last
        snap.learner = {"step": learner.step, "policy_version": learner.policy_version, "paused": learner.paused,
                        "job_id": last.job_id, "signals": {k: last.values[k] for k in SIGNALS if k in last.values}}
        if last.step:
            before = last.policy_version - 1  # the version this step updated from
            snap.learner["policy_lag"] = before - last.mean_sample_policy_version
            snap.learner["policy_lag_max"] = before - last.min_sample_policy_version
    elif metrics:  # the learner does not answer: its last step as the monitor recorded it
        last_point = metrics[-1]
        snap.learner = {"step": last_point.step,
                        "signals": {k: last_point.values[k] for k in SIGNALS if k in last_point.values}}
    snap.throughput = _throughput(metrics, window)
    answered = [s for s in shard_stats if s is not None]
    if answered:  # the sums over the shards that answered (a shard down: its status says so, its groups are missing)
        snap.replay = {"table": answered[0].table, **{k: sum(getattr(s, k) for s in answered) for k in (
                           "size", "inserts", "samples", "bytes",
                           "leased")},  # leased: drawn by a learner under a lease, not yet acknowledged
                       "current_policy_version": max(s.current_policy_version for s in answered)}
        if len(shards) > 1:
            snap.replay["shards"] = {n: (s.size if s is not None else None) for n, s in zip(shards, shard_stats)}
    return snap


def to_json(snap: Snapshot) -> str:
    return json.dumps(asdict(snap), indent=2)


# -- rendering ---------------------------------------------------------------------------------
def _f(v: float | None, fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def render(snap: Snapshot, plain: bool = False):
    """The view of ``snap`` as one rich renderable (a Group of tables). ``plain``: ASCII boxes, no styles
    (for a file or a pipe)."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    bx = box.ASCII if plain else box.SIMPLE_HEAD

    def table(title: str, *columns: str) -> Table:
        t = Table(title=title, box=bx, title_justify="left", show_edge=plain, pad_edge=plain)
        for c in columns:
            t.add_column(c, justify="left" if c in ("domain", "detector", "message", "evidence", "policy",
                                                    "service", "state", "severity") else "right")
        return t

    j = snap.job
    when = time.strftime("%H:%M:%S", time.localtime(snap.taken_unix))
    if j.get("state"):
        head = (f"job {j['job_id']}  {j['state'].upper()}  step {j['steps_done']}/{j['steps']}  "
                f"groups {j['groups_published']} published, {j['groups_scored']} scored")
        if j.get("pause_reason"):
            head += f"\n  paused: {j['pause_reason']}"
        if j.get("error"):
            head += f"\n  error: {j['error']}"
    elif j.get("job_id"):
        head = f"job {j['job_id']}  (the scheduler does not know it)"
    else:
        head = "no job (the scheduler has run none)" if snap.services["scheduler"] == UP else "no job known"
    parts = [Text(f"temper monitor  {snap.home}  {when}", style="" if plain else "bold"), Text(head)]

    down = {n: s for n, s in snap.services.items() if s != UP}
    if down:
        t = table("services", "service", "state")
        for n, s in down.items():
            t.add_row(n, s, style="" if plain else "red")
        parts.append(t)

    t = table("domains" + (f"  (accuracy: {snap.eval['phase']} eval, policy v{snap.eval['policy_version']})"
                           if snap.eval else ""),
              "domain", "step", "reward", "recent", "pass rate", "accuracy", "length", "weight",
              *(["adapter"] if (adapters := any(d.adapter for d in snap.domains)) else []))
    for d in snap.domains:
        t.add_row(d.domain, _f(d.step, "d"), _f(d.reward), _f(d.recent_reward), _f(d.pass_rate), _f(d.accuracy),
                  _f(d.length, ".1f"), _f(d.weight, ".2f"), *([d.adapter or "(base)"] if adapters else []))
    parts.append(t)

    ln, tp, rp = snap.learner, snap.throughput, snap.replay
    sig = ln.get("signals", {})
    t = table("training", "learner step", "policy", "lag (mean/max)", *[k for k in SIGNALS if k in sig],
              "steps/min", "tokens/s", "train tok/s", "replay size")
    lag = (f"{ln['policy_lag']:.2f}/{ln['policy_lag_max']:.0f}" if "policy_lag" in ln else "-") \
        + (f" (<= {j['max_policy_lag']})" if "max_policy_lag" in j else "")
    t.add_row(_f(ln.get("step"), "d"), f"v{ln['policy_version']}" if "policy_version" in ln else "-", lag,
              *[_f(sig[k], ".4g") for k in SIGNALS if k in sig], _f(tp.get("steps_per_minute"), ".1f"),
              _f(tp.get("tokens_per_second"), ".0f"), _f(tp.get("train_tokens_per_second"), ".0f"),
              _f(rp.get("size"), "d") + (f" (+{rp['leased']} leased)" if rp.get("leased") else "")
              + (f" over {len(rp['shards'])} shards" if rp.get("shards") else ""))
    parts.append(t)

    t = table(f"latest alerts ({len(snap.alerts)})", "step", "domain", "detector", "severity", "policy",
              "message", "evidence")
    for a in snap.alerts:
        style = "" if plain else {"critical": "bold red", "warning": "yellow"}.get(a.severity, "")
        policy = a.policy + (f" -> {a.action_result}" if a.action_result else "")
        t.add_row(str(a.step), a.domain, a.detector, a.severity, policy, a.message, a.evidence, style=style)
    if not snap.alerts:
        t.add_row("-", "", "no alerts", "", "", "", "")
    parts.append(t)
    return Group(*parts)


def print_frame(snap: Snapshot, console) -> None:
    console.print(render(snap, plain=not console.is_terminal))


def live(fetch, interval: float, console) -> None:
    """Redraw ``fetch()`` every ``interval`` seconds until Ctrl-C (a pipe gets one plain frame per interval)."""
    from rich.live import Live

    if not console.is_terminal:
        while True:
            print_frame(fetch(), console)
            console.print()
            time.sleep(interval)
    with Live(render(fetch()), console=console, auto_refresh=False, screen=False) as view:
        while True:
            time.sleep(interval)
            view.update(render(fetch()), refresh=True)
