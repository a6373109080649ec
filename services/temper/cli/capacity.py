"""`temper capacity`: calibrate the capacity model on runs, check it, and plan a cluster (temper.capacity)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from pydantic import ValidationError

from temper.capacity.calibrate import check, fit, measure_run
from temper.capacity.model import CapacitySpec, Prediction, plan, predict
from temper.cli.plan import toml_table


def _rows(rows: list[dict]) -> str:
    lines = [f"{'run':<40} {'prompts':>7} {'lag':>3} {'inf':>3} {'predicted s':>11} {'measured s':>10} "
             f"{'ratio':>6}  bottleneck"]
    for r in rows:
        lines.append(f"{r['run'][-40:]:<40} {r['prompts_per_step']:>7} {r['max_policy_lag']:>3} "
                     f"{r['inference_replicas']:>3} {r['predicted_seconds']:>11.3f} {r['measured_seconds']:>10.3f} "
                     f"{r['ratio']:>6.2f}  {r['bottleneck']}")
    return "\n".join(lines)


def calibrate(runs: list[str], checks: list[str], out: str, as_json: bool) -> int:
    measured = [measure_run(Path(r)) for r in runs]
    costs = fit(measured, source="temper capacity calibrate " + " ".join(runs))
    rows = check(costs, [*measured, *[measure_run(Path(r)) for r in checks]])
    for row, name in zip(rows, [*runs, *checks]):
        row["fitted_on"] = name in runs
    if out:
        Path(out).write_text("\n".join(toml_table(["costs"], costs.model_dump())) + "\n")
    if as_json:
        print(json.dumps({"costs": costs.model_dump(), "check": rows}, indent=2))
        return 0
    print("costs: " + ", ".join(f"{k} {v:.6g}" for k, v in costs.model_dump().items() if isinstance(v, float)))
    print(_rows(rows))
    held = [r["ratio"] for r in rows if not r["fitted_on"]]
    if held:
        print(f"runs not fitted on: predicted/measured {min(held):.2f} .. {max(held):.2f}")
    if out:
        print(f"costs written to {out} (a [costs] table for `temper capacity plan`)")
    return 0


def render(p: Prediction, heading: str) -> str:
    a, t = p.allocation, p.stages
    lines = [heading,
             f"  step {p.step_seconds:.3f} s ({p.samples_per_second:.1f} samples/s, "
             f"{p.train_tokens_per_second:.0f} train tokens/s); bottleneck: {p.bottleneck}",
             f"  replicas: inference {a.inference_replicas}, learner ranks {a.learner_ranks}, reward "
             f"{a.reward_replicas}, sandbox slots {a.sandbox_slots}, replay shards {a.replay_shards}",
             "  stage seconds per step (busy fraction): " + ", ".join(
                 f"{s} {v:.3f} ({p.busy[s]:.0%})" for s, v in
                 (("generate", t.generate), ("score", t.score), ("store", t.store), ("train", t.train + t.push))),
             f"  of which push {t.push:.3f}, reward {t.detail['reward']:.3f}, sandbox {t.detail['sandbox']:.3f}; "
             f"step overhead {t.overhead:.3f}",
             f"  enough to keep up with this step time: reward {p.enough['reward_replicas']}, sandbox slots "
             f"{p.enough['sandbox_slots']}, replay shards {p.enough['replay_shards']} (the rest of the cores idle)"]
    return "\n".join(lines)


def plan_file(path: str, as_json: bool) -> int:
    try:
        spec = CapacitySpec.model_validate(tomllib.loads(Path(path).read_text()))
    except (ValidationError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{path}: {e}") from None
    if spec.allocation is not None:
        p = predict(spec.costs, spec.workload, spec.allocation)
        heading = "the given allocation"
    else:
        p = plan(spec.costs, spec.workload, spec.cluster)
        heading = f"best split of {spec.cluster.gpus} GPUs and {spec.cluster.cpu_cores} cores"
    print(json.dumps(p.as_dict(), indent=2) if as_json else render(p, heading))
    return 0


def add_commands(sub, command, common) -> None:
    cp = sub.add_parser("capacity", help="step time and bottleneck of a job on a cluster (the capacity model)",
                        parents=[common])
    cpsub = cp.add_subparsers(dest="capacity_command", required=True)
    ca = command("calibrate", lambda a: calibrate(a.runs, a.check, a.out, a.json),
                 "fit the model's costs on run folders `temper run` wrote (different batch sizes), and compare "
                 "its step times with the measured ones", into=cpsub)
    ca.add_argument("runs", nargs="+", help="run folders to fit on (each names its home's span files)")
    ca.add_argument("--check", nargs="*", default=[], help="run folders not fitted on: predicted vs measured")
    ca.add_argument("--out", default="", help="write the fitted [costs] table here (TOML)")
    ca.add_argument("--json", action="store_true")
    pl = command("plan", lambda a: plan_file(a.spec, a.json),
                 "a TOML of [costs], [workload] and [cluster] (the best split of its GPUs and cores) or "
                 "[allocation] (that split's step time)", into=cpsub)
    pl.add_argument("spec")
    pl.add_argument("--json", action="store_true")
