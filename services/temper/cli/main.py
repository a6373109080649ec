"""The `temper` command: local stack control and the embedded default job.

  temper up [SERVICE ...]   start the broker and services (all by default); returns when healthy
  temper status             health and address of each process
  temper down               stop everything `up` started
  temper restart SERVICE    stop one service and start it again (--kill: SIGKILL)
  temper run                up + the default job + report (runs/latest) + down
  temper sandbox exec FILE  run FILE in the gVisor sandbox service; prints the verdict as JSON ("status")
  temper sandbox test PROGRAM TESTFILE   run PROGRAM against the tests in TESTFILE
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
    from temper.cli.job import follow_job, write_report
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


# -- temper sandbox: always through the sandbox service (the one `temper up` started, else a short-lived one)
def _sandbox_call(args, method: str, request):
    """(response, via): the call made through the SDK against the sandbox service of ``--home`` if it is
    up, else against one started for this call in a temporary home and stopped after it."""
    import tempfile

    import grpc

    from temper.client.sdk import SandboxClient
    from temper.runtime.rpc import check_health

    launcher = _launcher(args)
    state = launcher.load()
    proc = state.services.get("sandbox") if state else None
    timeout = 60 + (request.limits.wall_seconds if method == "Execute" else 10 * len(request.tests))

    def call(address: str):
        with SandboxClient(address) as client:
            return getattr(client.stub, method)(request, timeout=timeout)

    try:
        if proc is not None and check_health(proc.address) == "SERVING":
            return call(proc.address), f"service {proc.address}"
        with tempfile.TemporaryDirectory(prefix="temper-sandbox-") as home:
            temp = Launcher(home=home, config=launcher.config_path)
            address = temp.up(["sandbox"]).services["sandbox"].address
            try:
                return call(address), "a sandbox service started for this call"
            finally:
                temp.down()
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
            raise ValueError(e.details()) from None
        raise RuntimeError(f"sandbox service: {e.code().name}: {e.details()}") from None


def _sandbox_program(args, path: str, stdin: bytes = b""):
    from temper.client.sdk import SandboxClient
    from temper.runtime.config import load_config
    from temper.sandbox.config import SandboxConfig

    language = args.language
    if not language:
        presets = load_config(SandboxConfig, ["--config", str(_launcher(args).config_path)]).language_presets()
        suffix = Path(path).suffix
        language = next((name for name, lang in presets.items() if suffix in lang.extensions), "")
        if not language:
            raise ValueError(f"cannot tell the language of {path}; pass --language")
    return SandboxClient.request(Path(path).read_bytes(), language, stdin=stdin, wall_seconds=args.timeout,
                                 memory_mb=args.memory_mb)


def _sandbox_result(r) -> dict:
    from temper.v1 import sandbox_pb2

    return {"status": sandbox_pb2.Verdict.Name(r.verdict), "message": r.message, "exit_code": r.exit_code,
            "signal": r.signal, "stdout": r.stdout.decode(errors="replace"), "stderr": r.stderr.decode(errors="replace"),
            "output_truncated": r.output_truncated, "wall_seconds": round(r.wall_seconds, 4),
            "cpu_seconds": round(r.cpu_seconds, 4), "peak_memory_bytes": r.peak_memory_bytes}


def cmd_sandbox_exec(args) -> int:
    stdin = Path(args.stdin).read_bytes() if args.stdin else b""
    resp, via = _sandbox_call(args, "Execute", _sandbox_program(args, args.file, stdin))
    out = {**_sandbox_result(resp), "via": via}
    print(json.dumps(out, indent=2))
    return 0 if out["status"] == "OK" else 1


def _load_tests(path: Path) -> list:
    """A .json list (or {"tests": [...]}) / .jsonl of {stdin, expected_stdout} or {assertion_script}
    objects; any other file is one Python assertion script."""
    from temper.v1 import sandbox_pb2

    text = path.read_text()
    if path.suffix == ".json":
        raw = json.loads(text)
        raw = raw["tests"] if isinstance(raw, dict) else raw
    elif path.suffix == ".jsonl":
        raw = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        return [sandbox_pb2.TestCase(assertion_script=text)]
    return [sandbox_pb2.TestCase(stdin=t.get("stdin", "").encode(), expected_stdout=t.get("expected_stdout", "").encode(),
                                 assertion_script=t.get("assertion_script", "")) for t in raw]


def cmd_sandbox_test(args) -> int:
    from temper.v1 import sandbox_pb2

    tests = _load_tests(Path(args.testfile))
    request = sandbox_pb2.RunTestsRequest(program=_sandbox_program(args, args.program), tests=tests,
                                          stop_on_first_failure=args.stop_on_first_failure)
    resp, via = _sandbox_call(args, "RunTests", request)
    results = [_sandbox_result(r) for r in resp.results]
    compiled = sandbox_pb2.Verdict.Name(resp.compile_verdict)
    status = compiled if compiled != "OK" else next((r["status"] for r in results if r["status"] != "OK"), "OK")
    out = {"status": status, "passed": resp.passed, "total": len(tests), "compile_status": compiled,
           "compile_message": resp.compile.stderr.decode(errors="replace") if compiled != "OK" else "",
           "results": results, "via": via}
    print(json.dumps(out, indent=2))
    return 0 if status == "OK" else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="temper", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--home", default=".temper", help="where state, logs and data live (default .temper)")
    parser.add_argument("--config", default=None, help="TOML config (default: the shipped job temper.jobs/toy.toml)")
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
    sb = sub.add_parser("sandbox", help="run code in the gVisor sandbox service (the running one, else a short-lived one)")
    sbsub = sb.add_subparsers(dest="sandbox_command", required=True)
    for name, helptext, fn in (("exec", "run FILE once; prints the verdict as JSON", cmd_sandbox_exec),
                               ("test", "run PROGRAM against TESTFILE (.json/.jsonl cases, or a Python "
                                        "assertion script)", cmd_sandbox_test)):
        p = sbsub.add_parser(name, help=helptext)
        if name == "exec":
            p.add_argument("file")
            p.add_argument("--stdin", default=None, help="file fed to the program's stdin")
        else:
            p.add_argument("program")
            p.add_argument("testfile")
            p.add_argument("--stop-on-first-failure", action="store_true")
        p.add_argument("--language", default="", help="python3, c, cpp, bash, ... (default: from the file name)")
        p.add_argument("--timeout", type=float, default=0.0, help="wall-clock seconds (default: the service's)")
        p.add_argument("--memory-mb", type=int, default=0, help="memory limit (default: the service's)")
        p.set_defaults(fn=fn)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (RuntimeError, TimeoutError, ValueError, FileNotFoundError) as e:
        print(f"temper: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
