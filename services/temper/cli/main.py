"""The `temper` command: local stack control and the embedded default job.

  temper up [SERVICE ...]   start the broker and services (all by default); returns when healthy
  temper status             health, address and restarts of each process
  temper down               stop everything `up` started
  temper restart SERVICE    stop one service (if it runs) and start it again (--kill: SIGKILL)
  temper run [--job NAME]   up + a job (default: the shipped default job) + report (runs/latest) + down
  temper run --dry-run      check the job and print its plan (services, model, domains, steps, budget); start nothing
  temper config show        the resolved configuration of the job and every service, each value's source
  temper eval --model DIR --domains D [D ...]   held-out greedy accuracy of a model folder alone
  temper monitor            live view of the running job (rewards, KL, entropy, lag, throughput, alerts)
  temper report RUN         PNG plots, report.json and TensorBoard events of a run folder (runs/latest) or of a
                            running job by id (the monitor's curves and alerts, the scheduler's evaluations)
  temper doctor             check what this machine needs, and say how to fix what is missing
  temper sandbox languages  the languages the sandbox runs, with their aliases (python, py, c++, sh, ...)
  temper sandbox exec FILE  run FILE in the gVisor sandbox service; prints the verdict as JSON ("status")
  temper sandbox test PROGRAM TESTFILE   run PROGRAM against the tests in TESTFILE
  temper prm label --from EXPORT --out LABELS --k 4 --budget N   Math-Shepherd step labels of exported
                            trajectories (rollouts from each step prefix, scored by the domain's verifier)
  temper prm grow --from EXPORT --out DIR [--register]   label, train a PRM, evaluate it on held-out tasks;
                            --register loads it into the running reward service
  temper reward load --prm DIR (or --rm DIR)   load a reward model into the running reward service, no restart
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from temper.client.transport import AUTH_TOKEN_FILE_ENV, TLS_DIR_ENV
from temper.runtime.errors import TemperError
from temper.runtime.launcher import SERVICES, Launcher


def _config_path(args) -> Path | None:
    """--config FILE or --job NAME (a shipped job); neither: the shipped default job."""
    from temper import jobs

    job = getattr(args, "job", None)
    if job and args.config:
        raise ValueError("give --config FILE or --job NAME, not both")
    return jobs.path(job) if job else args.config


def _launcher(args) -> Launcher:
    return Launcher(home=args.home, config=_config_path(args))


def cmd_up(args) -> int:
    # supervised by a detached process (temper.runtime.supervisor) that outlives this command
    state = _launcher(args).up(args.services or None, timeout=args.timeout, supervise="process")
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
        line = f"{r['name']:<10} {r['address']:<21} pid {r['pid']:<8} {r['health']:<11}"
        if "restarts" in r:
            line += f" restarts {r['restarts']}" + (f" (last: {r['last_exit']})" if r["last_exit"] else "")
        print(line + (f"\n           {r['failed']}" if r.get("failed") else ""))
    return 0 if all(r["health"] in ("SERVING", "RUNNING") for r in rows) else 1


def _running(args, service: str) -> str:
    state = _launcher(args).load()
    if state is None or service not in state.services:
        raise SystemExit(f"temper: {service} is not up in {args.home} (start it with `temper up`)")
    return state.services[service].address


def cmd_alerts(args) -> int:
    """The monitor's alerts, oldest first (ListAlerts with filters)."""
    from google.protobuf.json_format import MessageToDict

    from temper.client.sdk import MonitorClient
    from temper.v1 import monitor_pb2

    with MonitorClient(_running(args, "monitor")) as monitor:
        alerts = monitor.list_alerts(job_id=args.job_id, domain=args.domain, detector=args.detector,
                                     min_severity=monitor_pb2.AlertSeverity.Value(f"ALERT_SEVERITY_{args.severity.upper()}")
                                     if args.severity else 0, limit=args.limit)
    if args.json:
        print(json.dumps([MessageToDict(a, preserving_proto_field_name=True) for a in alerts], indent=2))
        return 0
    for a in alerts:
        sev = monitor_pb2.AlertSeverity.Name(a.severity).removeprefix("ALERT_SEVERITY_").lower()
        act = monitor_pb2.AlertAction.Name(a.action).removeprefix("ALERT_ACTION_").lower()
        print(f"{a.job_id} {a.domain} step {a.step} {a.detector} [{sev}, {act}] {a.message}"
              + (f" -> {a.action_result}" if a.action_result else "")
              + (f"\n    e.g. {', '.join(a.evidence.trajectory_ids[:3])}" if a.evidence.trajectory_ids else ""))
    if not alerts:
        print("no alerts")
    return 0


def cmd_monitor(args) -> int:
    """A live view of a job (temper.cli.monitor): redrawn every --interval seconds; --once / --json: one frame."""
    from rich.console import Console

    from temper.cli import monitor

    launcher = _launcher(args)

    def fetch():
        snap = monitor.gather(launcher.load(), job_id=args.job_id, table=args.table, alerts=args.alerts)
        snap.home = str(launcher.home)
        return snap

    if args.json:
        print(monitor.to_json(fetch()))
        return 0
    # a pipe or a file gets plain text, as wide as the tables need (rich would wrap them at 80 columns)
    console = Console() if sys.stdout.isatty() or "COLUMNS" in os.environ else Console(width=200)
    if args.once:
        monitor.print_frame(fetch(), console)
        return 0
    try:
        monitor.live(fetch, args.interval, console)
    except KeyboardInterrupt:
        pass
    return 0


def cmd_report(args) -> int:
    """A run folder's report (its summary.json), or a job's from the running services (temper.cli.report)."""
    import grpc

    from temper.cli import report

    run = Path(args.run)
    if run.exists():
        data = report.from_summary(run)
        out = Path(args.out) if args.out else (run if run.is_dir() else run.parent)
    else:
        try:
            data = report.from_services(_launcher(args).load(), args.run)
        except grpc.RpcError as e:
            raise RuntimeError(f"report of job {args.run}: {e.code().name}: {e.details()}") from None
        out = Path(args.out) if args.out else Path(args.runs) / args.run
    report.write(out, data)
    s = report.summarize(data)
    line = f"job {data.job_id}" + (f" ({data.state})" if data.state else "") + f": {s['reward']['steps']} learner steps"
    if s["reward"]["steps"]:
        line += f", reward {s['reward']['first']:.3f} -> {s['reward']['last']:.3f}"
    if "eval" in s:
        before, after = s["eval"]["before"], s["eval"]["after"]
        line += (f", held-out {sum(before.values()) / max(1, len(before)):.3f} -> "
                 f"{sum(after.values()) / max(1, len(after)):.3f}")
    line += f", {len(data.alerts)} alerts"
    print(line)
    print(f"report: {out}/report.json, reward_curve.png, training.png" + (", eval_accuracy.png" if data.evals else "")
          + f"; TensorBoard: tensorboard --logdir {out}/tb")
    return 0


def cmd_resume(args) -> int:
    """Continue a job the monitor (or anyone) paused."""
    from temper.client.sdk import SchedulerClient
    from temper.v1 import scheduler_pb2

    with SchedulerClient(_running(args, "scheduler")) as scheduler:
        status = scheduler.resume_job(args.job_id)
    print(f"job {status.job_id} {scheduler_pb2.JobState.Name(status.state)}")
    return 0


def cmd_down(args) -> int:
    launcher = _launcher(args)
    stopped = launcher.down()
    if launcher.jobs_ended:
        print("jobs stopped: " + ", ".join(launcher.jobs_ended))
    print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
    return 0


def cmd_restart(args) -> int:
    p = _launcher(args).restart(args.service, kill=args.kill)
    print(f"{p.name:<10} {p.address}  pid {p.pid}  SERVING")
    return 0


def _plan(args):
    from temper.cli.plan import make_plan

    return make_plan(_launcher(args), getattr(args, "steps", 0), getattr(args, "seed", None),
                     getattr(args, "timeout", 0.0), getattr(args, "job_timeout", 0.0), getattr(args, "runs", "runs"))


def cmd_config_show(args) -> int:
    from temper.cli.plan import render_config

    print(render_config(_plan(args)), end="")
    return 0


def cmd_run(args) -> int:
    import uuid

    from temper.cli.job import JobTimedOut, end_job, follow_job, repeated_domains, write_report
    from temper.client.sdk import LearnerClient

    plan = _plan(args)  # every check of the run, before anything starts (the same for --dry-run)
    if args.dry_run:
        from temper.cli.plan import render_plan

        print(render_plan(plan))
        return 0
    launcher, config, spec, model = _launcher(args), plan.table, plan.spec, plan.model
    spec.job_id = spec.job_id or f"job-{uuid.uuid4().hex[:8]}"  # known here, so the job ends with this run
    out = (Path(args.runs) / time.strftime("%Y%m%d-%H%M%S")).resolve()
    t0 = time.monotonic()
    print(f"starting Temper ({', '.join(SERVICES)}) with {model.dir} ...", flush=True)
    state = launcher.up(timeout=args.timeout)
    try:
        up_seconds = time.monotonic() - t0
        print(f"up in {up_seconds:.1f}s; job: {spec.steps} steps x {spec.prompts_per_step} prompts x "
              f"{spec.group_size} samples over {', '.join(spec.domains)} (max policy lag {spec.max_policy_lag})",
              flush=True)
        t1 = time.monotonic()
        # a service the supervisor gave up on ([launcher] max_restarts, restart = "never") fails the job
        try:
            followed = follow_job(state, spec, timeout=args.job_timeout, check=launcher.raise_if_failed)
        except JobTimedOut as e:  # what the job did so far is reported, then the run fails
            write_report(out, spec, config, e.followed.steps, time.monotonic() - t1, e.followed,
                         extra={"model_dir": str(model.dir), "home": str(launcher.home), "up_seconds": up_seconds,
                                "incomplete": str(e),
                                "total_seconds": time.monotonic() - t0})
            print(f"partial report of the unfinished job: {out}/summary.json", flush=True)
            raise
        steps = followed.steps
        wall = time.monotonic() - t1
        with LearnerClient(state.services["learner"].address) as learner:
            exported = learner.export_policy(str(out / "policy"), timeout=600)
    finally:
        end_job(state, spec.job_id)  # paused or interrupted: its saved state must not resume in a later stack
        launcher.down()
    out = write_report(out, spec, config, steps, wall, followed,
                       extra={"model_dir": str(model.dir), "home": str(launcher.home), "up_seconds": up_seconds,
                              "total_seconds": time.monotonic() - t0,
                              "policy": {"path": exported.path, "policy_version": exported.policy_version,
                                         "bytes": exported.bytes}})
    summary = json.loads((out / "summary.json").read_text())
    print(f"reward {summary['reward_first_steps']:.3f} (first steps) -> {summary['reward_last_steps']:.3f} "
          f"(last steps); {summary['steps_per_minute']:.1f} steps/min; report: {out}/summary.json, "
          f"{out}/reward_curve.png; policy: {exported.path}")
    ev = summary["eval"]
    if ev:
        print("held-out accuracy: " + "  ".join(
            f"{d} {ev['before']['accuracy'][d]:.2f} -> {ev['after']['accuracy'][d]:.2f}" for d in ev["gain"])
            + f"  ({out}/eval_accuracy.png)")
        beyond = [d for d in ev["gain"] if d in ev["after"].get("accuracy_beyond_majority", {})
                  and d in ev["before"].get("accuracy_beyond_majority", {}) and d in ev.get("majority_share", {})]
        if beyond:  # a gain that is the policy learning each domain's most common answer shows here as none
            print("  beyond the most common answer: " + "  ".join(
                f"{d} {ev['before']['accuracy_beyond_majority'][d]:.2f} -> {ev['after']['accuracy_beyond_majority'][d]:.2f}"
                f" ({ev['majority_share'][d]:.0%} of problems share one answer)" for d in beyond))
    if memorised := repeated_domains(summary.get("sampling", {})):
        print("training prompts repeated (draws that repeat an earlier prompt; held-out accuracy stops following "
              "the reward of a domain the job memorises): " + "  ".join(
                  f"{d['domain']} {d['repeated_prompts']}/{d['drawn']}" for d in memorised))
    if followed.paused:
        print(f"the monitor paused the job after {len(steps)} of {spec.steps} steps: {followed.status.pause_reason}")
        return 3
    return 0


class _ModelLauncher(Launcher):
    """A launcher whose [model] is the folder given on the command line (temper eval)."""

    def __init__(self, home, config, model_dir: str):
        super().__init__(home=home, config=config)
        self.model_table = {"dir": str(Path(model_dir).resolve())}

    def config(self) -> dict:
        return {**super().config(), "model": self.model_table}


def cmd_eval(args) -> int:
    import os
    import tempfile

    from temper.client.sdk import InferenceClient, RewardClient
    from temper.models import check_model_dir
    from temper.scheduler.evaluation import EvalSets, evaluate

    info = check_model_dir(Path(args.model), field="--model")
    base = _launcher(args)
    config = base.config()
    job = dict(config.get("job", {}))
    domains = args.domains or list(job.get("domains", []))
    if not domains:
        raise ValueError("--domains: at least one domain")
    from temper import tasks
    from temper.scheduler.core import domain_known

    # dataset paths: the job file's relative to its folder, the command line's to the working directory
    domain_config = tasks.resolve_paths(dict(job.get("domain_config", {})), base.config_path.parent)
    if args.domain_config:
        domain_config.update(tasks.resolve_paths(json.loads(args.domain_config), Path.cwd()))
    domain_config = {d: c for d, c in domain_config.items() if d in domains}
    for d in domains:
        if not domain_known(d):
            raise ValueError(f"--domains: unknown domain {d!r}")
    for d, c in domain_config.items():
        tasks.check_config(d, c, field=f"domain_config[{d}]")
    chat = info.has_chat_template if args.chat_template is None else args.chat_template
    prefix = job.get("response_prefix", "") if args.response_prefix is None else args.response_prefix
    if prefix and not chat:
        raise ValueError("--response-prefix needs the chat template")
    max_tokens = args.max_tokens or int(job.get("eval", {}).get("max_tokens", 0) or job.get("max_tokens", 64))
    stop = list(job.get("stop", []))  # answers end as the job's do
    sets = EvalSets(domains, args.size, args.seed, domain_config)
    job_eval = job.get("eval", {})
    samples = int(job_eval.get("samples", 1) if args.samples is None else args.samples)
    temperature = float(job_eval.get("temperature", 0.0) if args.temperature is None else args.temperature)
    if samples < 1 or samples > 64:
        raise ValueError(f"--samples: must be in [1, 64], got {samples}")
    if temperature < 0 or (temperature == 0 and samples > 1):
        raise ValueError(f"--temperature: must be >= 0, and > 0 for {samples} samples per problem, got {temperature}")
    if args.engine:
        os.environ["TEMPER_INFERENCE_ENGINE"] = args.engine
    # code domains, and datasets scored by the code or tests-folder verifier, run their tests in the sandbox
    code = any(d.startswith("code.") or str(domain_config.get(d, {}).get("verifier", "")).startswith(("code.", "tests."))
               for d in domains)
    services = ["inference", "reward"] + (["sandbox"] if code else [])
    with tempfile.TemporaryDirectory(prefix="temper-eval-") as home:
        launcher = _ModelLauncher(home, base.config_path, args.model)
        t0 = time.monotonic()
        state = launcher.up(services, timeout=args.timeout)
        try:
            up_seconds = time.monotonic() - t0
            with InferenceClient(state.services["inference"].address, timeout=3600) as inference, \
                    RewardClient(state.services["reward"].address) as reward:
                def answer(prompts, n_tokens, n, temperature, seed):
                    return inference.generate(prompts, n=n, temperature=temperature, max_tokens=n_tokens, seed=seed,
                                              apply_chat_template=chat, assistant_prefix=prefix, stop=stop)

                result = evaluate(sets, answer, reward.score, max_tokens, "standalone", response_prefix=prefix,
                                  samples=samples, temperature=temperature, seed=args.seed)
        finally:
            launcher.down()
    out = {"model": str(info.dir), "engine": args.engine or config.get("inference", {}).get("engine", "vllm"),
           "chat_template": chat, "response_prefix": prefix, "size": args.size, "seed": args.seed, "max_tokens": max_tokens,
           "samples": samples, "temperature": temperature,
           "domain_config": domain_config, "accuracy": dict(result.accuracy), "mean_reward": dict(result.mean_reward),
           "accuracy_stderr": dict(result.accuracy_stderr), "pass_at_k": dict(result.pass_at_k),
           "majority_share": dict(result.majority_share), "accuracy_beyond_majority": dict(result.accuracy_beyond_majority),
           "seconds": result.seconds, "up_seconds": up_seconds, "generated_tokens": result.generated_tokens,
           "tokens_per_second": result.generated_tokens / result.seconds if result.seconds else 0.0}
    for d in domains:
        print(f"{d:<32} accuracy {result.accuracy[d]:.3f} ± {result.accuracy_stderr[d]:.3f}  "
              f"mean reward {result.mean_reward[d]:.3f}"
              + (f"  pass@{samples} {result.pass_at_k[d]:.3f}" if samples > 1 else "")
              + (f"  beyond the most common answer ({result.majority_share[d]:.0%} of problems) "
                 f"{result.accuracy_beyond_majority[d]:.3f}" if d in result.accuracy_beyond_majority else ""))
    how = "greedy" if temperature == 0 else f"{samples} samples at T = {temperature:g} (pass@1 averaged)"
    print(f"{args.size} problems per domain (seed {args.seed}), {how}, {max_tokens} tokens max, "
          f"{out['tokens_per_second']:.0f} tok/s")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
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
    from temper.client.sdk import verdict_name

    return {"status": verdict_name(r.verdict), "message": r.message, "exit_code": r.exit_code,
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
    from temper.client.sdk import verdict_name
    from temper.v1 import sandbox_pb2

    tests = _load_tests(Path(args.testfile))
    request = sandbox_pb2.RunTestsRequest(program=_sandbox_program(args, args.program), tests=tests,
                                          stop_on_first_failure=args.stop_on_first_failure)
    resp, via = _sandbox_call(args, "RunTests", request)
    results = [_sandbox_result(r) for r in resp.results]
    compiled = verdict_name(resp.compile_verdict)
    status = compiled if compiled != "OK" else next((r["status"] for r in results if r["status"] != "OK"), "OK")
    out = {"status": status, "passed": resp.passed, "total": len(tests), "compile_status": compiled,
           "compile_message": resp.compile.stderr.decode(errors="replace") if compiled != "OK" else "",
           "results": results, "via": via}
    print(json.dumps(out, indent=2))
    return 0 if status == "OK" else 1


def _job_names() -> list[str]:
    from temper import jobs

    return jobs.names()


def cmd_sandbox_languages(args) -> int:
    from temper.runtime.config import load_config
    from temper.sandbox.config import SandboxConfig

    presets = load_config(SandboxConfig, ["--config", str(_launcher(args).config_path)]).language_presets()
    seen = {}
    for lang in presets.values():
        seen.setdefault(lang.name, lang)
    for name, lang in sorted(seen.items()):
        tests = "assertion scripts + stdin/stdout" if lang.test_harness else "stdin/stdout"
        print(f"{name:<10} aliases: {', '.join(lang.aliases) or '-':<28} files: {', '.join(lang.extensions) or '-':<16} "
              f"tests: {tests}")
    return 0


def cmd_doctor(args) -> int:
    from temper.cli.doctor import run_checks

    checks = run_checks(_launcher(args).config_path, Path(args.home))
    for c in checks:
        print(f"{'ok ' if c.ok else 'FAIL'}  {c.name:<22} {c.detail}")
        if not c.ok and c.fix:
            print(f"      {'':<22} fix: {c.fix}")
    failed = [c for c in checks if not c.ok]
    print("everything Temper needs is here" if not failed else f"{len(failed)} problem(s) found")
    return 1 if failed else 0


def _global_options(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """--home, --config and --log-level, accepted before the subcommand (``defaults``) and after it
    (SUPPRESS: given there, they override; absent, the value from before the subcommand stands)."""
    d = (lambda v: v) if defaults else (lambda v: argparse.SUPPRESS)
    parser.add_argument("--home", default=d(os.environ.get("TEMPER_HOME", ".temper")),
                        help="where state, logs and data live (default $TEMPER_HOME, else .temper)")
    parser.add_argument("--config", default=d(None), help="job/service TOML config (default: the shipped default "
                                                          "job, temper/jobs; or --job NAME where offered)")
    parser.add_argument("--log-level", default=d(None), choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log level of the services this command starts")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"temper {version('temper')} (temper-client {version('temper-client')})"
    except PackageNotFoundError:
        return "temper (not installed as a distribution)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="temper", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    _global_options(parser, defaults=True)
    common = argparse.ArgumentParser(add_help=False)
    _global_options(common, defaults=False)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, fn, helptext: str, into=sub) -> argparse.ArgumentParser:
        p = into.add_parser(name, help=helptext, parents=[common])
        p.set_defaults(fn=fn)
        return p

    up = command("up", cmd_up, "start the broker and services")
    up.add_argument("services", nargs="*", choices=[[], *SERVICES], metavar="SERVICE")
    up.add_argument("--timeout", type=float, default=120.0)
    st = command("status", cmd_status, "health and address of each process")
    st.add_argument("--json", action="store_true")
    command("down", cmd_down, "stop everything `up` started")
    rs = command("restart", cmd_restart, "stop one service and start it again on the same address")
    rs.add_argument("service", help=f"one of {', '.join(SERVICES)}, or a replica's name from `temper status` "
                                    "(inference-1)")
    rs.add_argument("--kill", action="store_true", help="SIGKILL instead of a graceful SIGTERM")
    run = command("run", cmd_run, "run a job (default: the shipped default job)")
    run.add_argument("--job", default=None, help="a shipped job by name (temper.jobs: " + ", ".join(_job_names())
                     + "); default: the shipped default")
    run.add_argument("--steps", type=int, default=0, help="override the job's steps")
    run.add_argument("--seed", type=int, default=None, help="override the job's seed")
    run.add_argument("--runs", default="runs", help="reports go to RUNS/<time>/ and RUNS/latest")
    run.add_argument("--timeout", type=float, default=180.0, help="start-up timeout, seconds")
    run.add_argument("--job-timeout", type=float, default=1800.0)
    run.add_argument("--dry-run", action="store_true", help="check everything and print the plan (services and "
                     "their start waves, model, domains, steps, eval, budget); start nothing")
    cf = sub.add_parser("config", help="the configuration a run resolves to", parents=[common])
    cfsub = cf.add_subparsers(dest="config_command", required=True)
    show = command("show", cmd_config_show, "every service's and the job's resolved configuration as TOML, each "
                   "value's source in a comment (default, file, env TEMPER_<SERVICE>_<FIELD>, flags)", into=cfsub)
    show.add_argument("--job", default=None, help="a shipped job by name (" + ", ".join(_job_names()) + ")")
    show.add_argument("--steps", type=int, default=0, help="as `temper run --steps`")
    show.add_argument("--seed", type=int, default=None, help="as `temper run --seed`")
    al = command("alerts", cmd_alerts, "the monitor's reward-hacking and anomaly alerts (filters: job, domain, ...)")
    al.add_argument("--job", dest="job_id", default="", help="a job id (not a shipped job name)")
    al.add_argument("--domain", default="")
    al.add_argument("--detector", default="")
    al.add_argument("--severity", default="", choices=["", "info", "warning", "critical"], help="at least this")
    al.add_argument("--limit", type=int, default=0, help="newest N (default 1000)")
    al.add_argument("--json", action="store_true")
    mo = command("monitor", cmd_monitor, "live view of a job: per-domain reward, accuracy and length, KL, entropy, "
                 "throughput, policy lag, replay size, latest alerts")
    mo.add_argument("--job", dest="job_id", default="", help="a job id (default: the running job, else the last)")
    mo.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    mo.add_argument("--once", action="store_true", help="print one frame and exit (plain text when not a terminal)")
    mo.add_argument("--json", action="store_true", help="print the frame's data as one JSON object and exit")
    mo.add_argument("--alerts", type=int, default=5, help="newest alerts shown")
    mo.add_argument("--table", default="default", help="the replay table whose size is shown")
    rp = command("report", cmd_report, "PNG plots, report.json and TensorBoard event files of a run")
    rp.add_argument("run", metavar="RUN", help="a run folder `temper run` wrote (runs/latest), or the id of a job "
                    "of the running services")
    rp.add_argument("--out", default="", help="where to write (default: the run folder, else RUNS/<job id>)")
    rp.add_argument("--runs", default="runs", help="a job id's report goes to RUNS/<job id>/ unless --out")
    command("resume", cmd_resume, "continue a paused job").add_argument("job_id", metavar="JOB")
    command("doctor", cmd_doctor, "check what this machine needs (runsc, broker, model, memory, ports)")
    ev = command("eval", cmd_eval, "held-out accuracy of a model folder (greedy, or pass@1 over sampled answers), "
                 "through inference and reward")
    ev.add_argument("--model", required=True, help="a Hugging Face causal-LM folder")
    ev.add_argument("--domains", nargs="+", default=None, help="domains (default: the job's)")
    ev.add_argument("--job", default=None, help="take domains, domain_config and settings from this shipped job")
    ev.add_argument("--domain-config", default="", help='JSON: {"rg.chain_sum": {"max_terms": 2}, ...}')
    ev.add_argument("--size", type=int, default=50, help="problems per domain")
    ev.add_argument("--seed", type=int, default=1_000_003, help="the eval sets' seed (a job's default)")
    ev.add_argument("--max-tokens", type=int, default=0, help="per answer (default: the job's eval/max tokens)")
    ev.add_argument("--samples", type=int, default=None, help="answers per problem (default: the job's eval.samples, "
                    "else 1)")
    ev.add_argument("--temperature", type=float, default=None, help="of the answers; 0: greedy (default: the job's "
                    "eval.temperature, else 0)")
    ev.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                    help="wrap prompts in the model's chat template (default: when it has one)")
    ev.add_argument("--response-prefix", default=None, help='prefilled start of every answer, e.g. "<answer>" '
                    "(default: the job's response_prefix)")
    ev.add_argument("--engine", default="", help="inference engine: vllm | hf (default: the config's)")
    ev.add_argument("--out", default="", help="write the result as JSON here")
    ev.add_argument("--timeout", type=float, default=300.0, help="start-up timeout, seconds")
    sb = sub.add_parser("sandbox", help="run code in the gVisor sandbox service (the running one, else a short-lived one)",
                        parents=[common])
    sbsub = sb.add_subparsers(dest="sandbox_command", required=True)
    command("languages", cmd_sandbox_languages, "the languages (and their aliases) the sandbox runs", into=sbsub)
    for name, helptext, fn in (("exec", "run FILE once; prints the verdict as JSON", cmd_sandbox_exec),
                               ("test", "run PROGRAM against TESTFILE (.json/.jsonl cases, or a Python "
                                        "assertion script)", cmd_sandbox_test)):
        p = command(name, fn, helptext, into=sbsub)
        if name == "exec":
            p.add_argument("file")
            p.add_argument("--stdin", default=None, help="file fed to the program's stdin")
        else:
            p.add_argument("program")
            p.add_argument("testfile")
            p.add_argument("--stop-on-first-failure", action="store_true")
        p.add_argument("--language", default="", help="python3, c, cpp, bash, ... or an alias (python, py, c++, sh); "
                                                      "default: from the file name")
        p.add_argument("--timeout", type=float, default=0.0, help="wall-clock seconds (default: the service's)")
        p.add_argument("--memory-mb", type=int, default=0, help="memory limit (default: the service's)")
    from temper.cli.prm import add_commands as add_prm_commands

    add_prm_commands(sub, command, common)
    from temper.cli.reward import add_commands as add_reward_commands

    add_reward_commands(sub, command, common)
    from temper.cli.capacity import add_commands as add_capacity_commands

    add_capacity_commands(sub, command, common)
    return parser


def _exit_on_signal(signum, frame):
    # SIGTERM/SIGHUP unwind like Ctrl-C: every `finally` runs, so a command that started services
    # (`temper run`, a short-lived sandbox) stops them instead of leaving them orphaned.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread():  # (signal handlers live in the main thread only)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _exit_on_signal)
    if args.log_level:  # every service reads TEMPER_<SERVICE>_LOG_LEVEL
        for name in SERVICES:
            os.environ[f"TEMPER_{name.upper()}_LOG_LEVEL"] = args.log_level
    try:
        state = Launcher(home=args.home).load()
        if state is not None and state.auth_token_file:  # the stack of --home wants its token: the SDK sends it
            os.environ.setdefault(AUTH_TOKEN_FILE_ENV, state.auth_token_file)
        if state is not None and state.tls_dir:  # [auth] tls: the CLI's calls present the stack's client certificate
            from temper.runtime.tls import CLIENT, tls_dir_of

            os.environ.setdefault(TLS_DIR_ENV, tls_dir_of(state.tls_dir, CLIENT))
        return args.fn(args)
    except (RuntimeError, TimeoutError, ValueError, FileNotFoundError, TemperError) as e:
        print(f"temper: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
