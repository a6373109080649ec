"""`temper report RUN`: a job's curves as PNG plots, a JSON summary and TensorBoard event files.

A report is built from one of two sources into one :class:`ReportData`:

- a job id (:func:`from_services`): the services of a home as they run now -- the monitor's per-step
  series (ListSteps: per domain from ``scored``, the learner's metrics as ``"*"``; they survive a
  monitor restart), its alerts (ListAlerts) and the scheduler's JobStatus (state, held-out
  evaluations);
- a run folder ``temper run`` wrote (:func:`from_summary`, e.g. ``runs/latest``): its summary.json
  (the learner's StepMetrics, the evaluations and the alerts it recorded). Nothing needs to be up.

:func:`write` renders one into a folder:

- ``report.json``: the data, and per domain the first and last steps' mean reward, the held-out
  accuracy before / after and its gain, alerts counted by detector;
- ``reward_curve.png``: mean reward per step, and per domain, each alert a dotted line at its step;
- ``training.png``: a panel per learner signal present (KL to the reference, approximate KL,
  entropy, clip fraction, grad norm, loss, step seconds) and the completion length per domain;
- ``eval_accuracy.png`` (when the job evaluated): held-out accuracy per domain by policy version;
- ``tb/``: TensorBoard event files (``tensorboard --logdir RUN/tb``): scalars ``reward/mean``,
  ``reward/<domain>``, ``learner/<key>``, ``scored/<domain>/<key>``, ``eval/<domain>`` (x: the
  policy version), each alert as text at its step. Writing a report again replaces them.

The x axis: learner step for the learner's series (its policy version after the step); for the
monitor's ``scored`` series, the scheduler step that generated the groups.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

Points = list[tuple[int, float]]
# the learner's signals drawn in training.png, in this order, when the job's steps have them
SIGNALS = ("kl_ref", "approx_kl", "entropy", "clip_fraction", "grad_norm", "loss", "step_seconds")


@dataclass
class ReportData:
    job_id: str
    source: str                                   # "services" or the summary.json read
    state: str = ""                               # done | failed | stopped | paused | running | ...
    learner: dict[str, Points] = field(default_factory=dict)             # key -> [(learner step, value)]
    scored: dict[str, dict[str, Points]] = field(default_factory=dict)   # domain -> key -> [(step, value)]
    evals: list[dict] = field(default_factory=list)   # phase, policy_version, accuracy{domain}, samples, ...
    alerts: list[dict] = field(default_factory=list)  # alert_id, step, domain, detector, severity, policy, message


def _short(name: str, prefix: str) -> str:
    return name.removeprefix(prefix).lower()


def _alert(a: dict) -> dict:
    """An alert as MessageToDict(preserving_proto_field_name=True) writes it (int64 as strings, enums by name)."""
    return {"alert_id": a.get("alert_id", ""), "step": int(a.get("step", 0)), "domain": a.get("domain", ""),
            "detector": a.get("detector", ""),
            "severity": _short(a.get("severity", "ALERT_SEVERITY_UNSPECIFIED"), "ALERT_SEVERITY_"),
            "policy": _short(a.get("action", "ALERT_ACTION_UNSPECIFIED"), "ALERT_ACTION_"),
            "message": a.get("message", "")}


def _eval(e: dict, defaults: dict) -> dict:
    return {"phase": e.get("phase", ""), "policy_version": int(e.get("policy_version", 0)),
            "accuracy": dict(e.get("accuracy", {})), "accuracy_stderr": dict(e.get("accuracy_stderr", {})),
            "samples": int(e.get("samples", defaults.get("samples", 1)) or 1),
            "temperature": float(e.get("temperature", defaults.get("temperature", 0.0))),
            "problems": int(e.get("problems", defaults.get("problems_per_domain", 0)))}


def from_summary(path: Path) -> ReportData:
    """The report of a run folder (or its summary.json) that ``temper run`` wrote."""
    path = Path(path)
    if path.is_dir():
        path = path / "summary.json"
    if not path.is_file():
        raise ValueError(f"run: {path} does not exist (give a run folder `temper run` wrote, or a job id)")
    return of_summary(json.loads(path.read_text()), path)


def of_summary(summary: dict, path: Path) -> ReportData:
    """The report of a run's summary (as summary.json holds it; ``path``: that file, the report's source)."""
    steps = summary.get("steps", [])
    job = summary.get("job", {})
    data = ReportData(job_id=job.get("job_id", "") or path.parent.name, source=str(path),
                      state=_short(summary.get("job_state", ""), "JOB_STATE_"))
    for s in steps:
        point = {"mean_reward": s["mean_reward"], "step_seconds": s.get("seconds", 0.0), **s.get("values", {})}
        for key, v in point.items():
            data.learner.setdefault(key, []).append((s["step"], float(v)))
        for d, v in s.get("domain_mean_reward", {}).items():
            data.scored.setdefault(d, {}).setdefault("reward", []).append((s["step"], float(v)))
    ev = summary.get("eval", {})
    data.evals = [_eval(e, ev) for e in ev.get("evals", [])]
    data.alerts = [_alert(a) for a in summary.get("alerts", [])]
    return data


def from_services(state, job_id: str, timeout: float = 30.0) -> ReportData:
    """The report of ``job_id`` from the monitor and the scheduler recorded in ``state`` (a launcher's State).
    The monitor must answer; without the scheduler the report has no state and no evaluations."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from temper.client.sdk import MonitorClient, SchedulerClient
    from temper.monitor.core import MAX_LIST
    from temper.v1 import scheduler_pb2

    def address(name: str) -> str | None:
        proc = state.services.get(name) if state is not None else None
        return proc.address if proc is not None and not proc.stopped else None

    if address("monitor") is None:
        raise ValueError("run: the monitor is not up in this home; a job id is reported from the running "
                         "services (give a run folder to report a finished `temper run`)")
    data = ReportData(job_id=job_id, source="services")
    with MonitorClient(address("monitor"), timeout=timeout) as monitor:
        series = monitor.list_steps(job_id, last=MAX_LIST)
        alerts = monitor.list_alerts(job_id=job_id, limit=MAX_LIST)
    for s in series:
        for p in s.steps:
            values = dict(p.values)
            target = data.learner if s.source == "metrics" else data.scored.setdefault(s.domain, {})
            for key, v in values.items():
                target.setdefault(key, []).append((p.step, v))
    data.alerts = [_alert(MessageToDict(a, preserving_proto_field_name=True)) for a in alerts]
    if address("scheduler") is not None:
        try:
            with SchedulerClient(address("scheduler"), timeout=timeout) as scheduler:
                status = scheduler.job(job_id)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
        else:
            data.state = _short(scheduler_pb2.JobState.Name(status.state), "JOB_STATE_")
            data.evals = [_eval(MessageToDict(e, preserving_proto_field_name=True,
                                              always_print_fields_with_no_presence=True), {}) for e in status.evals]
    if not series and not data.evals:
        raise ValueError(f"run: the monitor and the scheduler know no job {job_id!r}")
    return data


def _mean(points: Points) -> float | None:
    vals = [v for _, v in points if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else None


def summarize(data: ReportData, window: int = 0) -> dict:
    """Per domain: the mean reward of the first and last ``window`` steps (0: a fifth of them, at least one),
    held-out accuracy before / after and the gain; alerts counted by detector."""
    def ends(points: Points) -> dict:
        k = window or max(1, len(points) // 5)
        return {"steps": len(points), "first": _mean(points[:k]), "last": _mean(points[-k:])}

    out = {"reward": ends(data.learner.get("mean_reward", [])),
           "domains": {d: ends(keys.get("reward", [])) for d, keys in sorted(data.scored.items())}}
    if data.evals:
        first, last = data.evals[0], data.evals[-1]
        out["eval"] = {"before": first["accuracy"], "after": last["accuracy"],
                       "before_version": first["policy_version"], "after_version": last["policy_version"],
                       "gain": {d: last["accuracy"][d] - a for d, a in first["accuracy"].items() if d in last["accuracy"]}}
    counts: dict[str, int] = {}
    for a in data.alerts:
        counts[a["detector"]] = counts.get(a["detector"], 0) + 1
    out["alerts"] = counts
    return out


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_rewards(data: ReportData, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    mean = data.learner.get("mean_reward", [])
    if mean:
        ax.plot([s for s, _ in mean], [v for _, v in mean], label="all (learner)", linewidth=2)
    for d, keys in sorted(data.scored.items()):
        pts = keys.get("reward", [])
        if pts:
            ax.plot([s for s, _ in pts], [v for _, v in pts], label=d, alpha=0.6)
    for a in data.alerts:
        ax.axvline(a["step"], linestyle=":", color="red" if a["severity"] == "critical" else "orange", alpha=0.7)
    ax.set_xlabel("step" + (" (alerts dotted)" if data.alerts else ""))
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    if mean or data.scored:
        ax.legend()
    ax.grid(alpha=0.3)
    _save(plt, fig, path)


def plot_training(data: ReportData, path: Path) -> None:
    panels = [(k, {"learner": data.learner[k]}) for k in SIGNALS if data.learner.get(k)]
    lengths = {d: keys["length"] for d, keys in sorted(data.scored.items()) if keys.get("length")}
    if lengths:
        panels.append(("completion length (tokens)", lengths))
    plt = _pyplot()
    cols = 2
    rows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(10, 2.6 * rows), squeeze=False)
    for ax, (title, lines) in zip(axes.flat, panels):
        for label, pts in lines.items():
            ax.plot([s for s, _ in pts], [v for _, v in pts], label=label)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if not panels:
        axes.flat[0].text(0.5, 0.5, "no learner signals recorded", ha="center", va="center")
    _save(plt, fig, path)


def plot_evals(evals: list[dict], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for d in evals[0]["accuracy"]:
        pts = [(e["policy_version"], e["accuracy"][d]) for e in evals if d in e["accuracy"]]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=d)
    first = evals[0]
    how = "greedy" if first["temperature"] == 0 else f"pass@1 of {first['samples']} samples, T = {first['temperature']:g}"
    ax.set_xlabel("policy version")
    ax.set_ylabel(f"held-out accuracy ({how}; {first['problems']} problems/domain)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend()
    ax.grid(alpha=0.3)
    _save(plt, fig, path)


def write_tensorboard(data: ReportData, logdir: Path) -> None:
    from tensorboardX import SummaryWriter

    logdir.mkdir(parents=True, exist_ok=True)
    for old in logdir.glob("events.out.tfevents.*"):  # a report written again replaces its events
        old.unlink()
    writer = SummaryWriter(str(logdir))
    try:
        for s, v in data.learner.get("mean_reward", []):
            writer.add_scalar("reward/mean", v, s)
        for key, pts in sorted(data.learner.items()):
            for s, v in pts:
                writer.add_scalar(f"learner/{key}", v, s)
        for d, keys in sorted(data.scored.items()):
            for key, pts in sorted(keys.items()):
                for s, v in pts:
                    writer.add_scalar(f"reward/{d}" if key == "reward" else f"scored/{d}/{key}", v, s)
        for e in data.evals:
            for d, acc in e["accuracy"].items():
                writer.add_scalar(f"eval/{d}", acc, e["policy_version"])
        for a in data.alerts:
            writer.add_text("alerts", f"**{a['detector']}** ({a['severity']}, {a['policy']}) {a['domain']}: "
                            f"{a['message']}", a["step"])
    finally:
        writer.close()


def write(out: Path, data: ReportData) -> Path:
    """Render ``data`` into ``out``: report.json, reward_curve.png, training.png, eval_accuracy.png, tb/."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"summary": summarize(data), **asdict(data)}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    plot_rewards(data, out / "reward_curve.png")
    plot_training(data, out / "training.png")
    if data.evals:
        plot_evals(data.evals, out / "eval_accuracy.png")
    write_tensorboard(data, out / "tb")
    return out
