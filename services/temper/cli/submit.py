"""``python -m temper.cli.submit``: run the ``[job]`` table of a config on a deployed Temper.

What ``temper run`` does on a laptop, against services that are already up (the Kubernetes Job
in deploy/k8s/base/job-submit.yaml runs it): submit the job to the scheduler, follow the learner's
metrics on Kafka, write the report (summary.json, reward_curve.png), upload it to ``--report-url``
and have the learner write the final policy as checkpoint ``final-<job id>`` (which its
``checkpoint_url`` uploads). A job id that already ran is not started twice: a restarted pod
follows nothing and exits non-zero with the scheduler's answer.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from temper.runtime.storage import ObjectStore, StorageError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m temper.cli.submit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="TOML file whose [job] table is the job")
    parser.add_argument("--job-id", default="", help="the job's id (default: [job] job_id, else generated)")
    parser.add_argument("--scheduler", required=True, help="host:port of the scheduler")
    parser.add_argument("--learner", default="", help="host:port of the learner: writes the final policy")
    parser.add_argument("--kafka-bootstrap", required=True)
    parser.add_argument("--report-url", default="", help="s3://bucket/prefix or a path; the report goes to <it>/<job id>/")
    parser.add_argument("--timeout", type=float, default=7 * 24 * 3600.0, help="seconds the job may take")
    return parser


def job_of(config: dict, source: Path, job_id: str = ""):
    """The config's [job] table as a validated JobSpec, read as `temper run` reads it (``[job.eval]``,
    ``[job.sampling]``, dataset paths relative to the file; ``[job.step_labels]`` is `temper prm`'s); a
    mistake is a ValueError naming the key."""
    from temper.cli.plan import job_spec

    job = dict(config.get("job", {}))
    if job_id:
        job["job_id"] = job_id
    spec = job_spec(job, source)
    if not spec.job_id:
        spec.job_id = time.strftime("job-%Y%m%d-%H%M%S", time.gmtime())
    return spec


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    from temper.cli.job import follow_job, write_report
    from temper.client.sdk import LearnerClient
    from temper.runtime.launcher import Proc, State

    try:  # check the store before the job starts, not after it ran for days
        reports = ObjectStore(args.report_url) if args.report_url else None
    except StorageError as e:
        print(f"temper-submit: --report-url: {e}", file=sys.stderr)
        return 1
    with open(args.config, "rb") as f:
        config = tomllib.load(f)
    try:
        spec = job_of(config, Path(args.config), args.job_id)
    except ValueError as e:
        print(f"temper-submit: {e}", file=sys.stderr)
        return 1
    state = State(home="", config=args.config, broker=Proc("broker", 0, args.kafka_bootstrap, ""),
                  services={"scheduler": Proc("scheduler", 0, args.scheduler, "")})
    t0 = time.monotonic()
    followed = follow_job(state, spec, timeout=args.timeout)
    wall = time.monotonic() - t0
    with tempfile.TemporaryDirectory(prefix="temper-report-") as tmp:
        out = write_report(Path(tmp) / spec.job_id, spec, config, followed.steps, wall, followed)
        if reports is not None:
            reports.put_dir(out, spec.job_id)
            print(f"report: {reports.url}/{spec.job_id}/summary.json")
    if args.learner:
        with LearnerClient(args.learner, timeout=3600.0) as learner:  # a large model takes a while to write
            final = learner.checkpoint(f"final-{spec.job_id}")
        print(f"final policy: checkpoint {final.path} (step {final.step}, policy version {final.policy_version})")
    if followed.paused:  # as `temper run`: the monitor paused it
        print(f"the monitor paused the job after {len(followed.steps)} of {spec.steps} steps: "
              f"{followed.status.pause_reason}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
