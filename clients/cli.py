"""The `temper` command: local stack control and the embedded default job.

  temper up [SERVICE ...]   start the broker and services (all by default); returns when healthy
  temper status             health and address of each process
  temper down               stop everything `up` started
  temper restart SERVICE    stop one service and start it again (--kill: SIGKILL)
  temper run                up + the default job + report (runs/latest) + down
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from temper.runtime.launcher import SERVICES, Launcher


def _launcher(args) -> Launcher:
    return Launcher(home=args.home, config=args.config)


def cmd_up(args) -> int:
    state = _launcher(args).up(args.services or None, timeout=args.timeout)
    print(f"broker     {state.kafka_bootstrap}")
    for p in state.services.values():
        print(f"{p.name:<10} {p.address}  pid {p.pid}  SERVING")
    return 0


def cmd_status(args) -> int:
    rows = _launcher(args).status()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("nothing is up")
        return 1
    for r in rows:
        print(f"{r['name']:<10} {r['address']:<21} pid {r['pid']:<8} {r['health']}")
    return 0 if all(r["health"] in ("SERVING", "RUNNING") for r in rows) else 1


def cmd_down(args) -> int:
    stopped = _launcher(args).down()
    print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
    return 0


def cmd_restart(args) -> int:
    p = _launcher(args).restart(args.service, kill=args.kill)
    print(f"{p.name:<10} {p.address}  pid {p.pid}  SERVING")
    return 0


def cmd_run(args) -> int:
    from temper.client.job import follow_job, write_report
    from temper.scheduler.core import JobSpec

    launcher = _launcher(args)
    config = launcher.config()
    job = dict(config.get("job", {}))
    if args.steps:
        job["steps"] = args.steps
    spec = JobSpec(**job)
    spec.validate()
    t0 = time.monotonic()
    print(f"starting Temper ({', '.join(SERVICES)}) ...", flush=True)
    state = launcher.up(timeout=args.timeout)
    try:
        print(f"up in {time.monotonic() - t0:.1f}s; job: {spec.steps} steps x {spec.prompts_per_step} prompts x "
              f"{spec.group_size} samples over {', '.join(spec.domains)}", flush=True)
        t1 = time.monotonic()
        steps = follow_job(state, spec, timeout=args.job_timeout)
        wall = time.monotonic() - t1
    finally:
        launcher.down()
    out = write_report(Path(args.runs) / time.strftime("%Y%m%d-%H%M%S"), spec, config, steps, wall)
    summary = json.loads((out / "summary.json").read_text())
    print(f"reward {summary['reward_first_steps']:.3f} (first steps) -> {summary['reward_last_steps']:.3f} "
          f"(last steps); {summary['steps_per_minute']:.1f} steps/min; report: {out}/summary.json, "
          f"{out}/reward_curve.png")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="temper", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--home", default=".temper", help="where state, logs and data live (default .temper)")
    parser.add_argument("--config", default=None, help="TOML config (default deploy/local/temper.toml)")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the broker and services")
    up.add_argument("services", nargs="*", choices=[[], *SERVICES], metavar="SERVICE")
    up.add_argument("--timeout", type=float, default=120.0)
    up.set_defaults(fn=cmd_up)
    st = sub.add_parser("status", help="health and address of each process")
    st.add_argument("--json", action="store_true")
    st.set_defaults(fn=cmd_status)
    sub.add_parser("down", help="stop everything `up` started").set_defaults(fn=cmd_down)
    rs = sub.add_parser("restart", help="stop one service and start it again on the same address")
    rs.add_argument("service", choices=SERVICES)
    rs.add_argument("--kill", action="store_true", help="SIGKILL instead of a graceful SIGTERM")
    rs.set_defaults(fn=cmd_restart)
    run = sub.add_parser("run", help="run the embedded default job")
    run.add_argument("--steps", type=int, default=0, help="override the job's steps")
    run.add_argument("--runs", default="runs", help="reports go to RUNS/<time>/ and RUNS/latest")
    run.add_argument("--timeout", type=float, default=180.0, help="start-up timeout, seconds")
    run.add_argument("--job-timeout", type=float, default=1800.0)
    run.set_defaults(fn=cmd_run)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (RuntimeError, TimeoutError, ValueError, FileNotFoundError) as e:
        print(f"temper: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
