"""What `temper run` will do, worked out and checked before anything starts.

``make_plan`` is the one validation of a run: the ``[job]`` table (with ``[job.step_labels]``, the
settings of `temper prm label`), the held-out sets, the ``[model]`` table, and every service's
configuration as the launcher will start it (its ``[<service>]`` table, ``TEMPER_<SERVICE>_<FIELD>``
environment, the launcher's flags), loaded with the services' own config classes
(``temper.runtime.config.load_config``). `temper run` calls it and then starts the plan;
`temper run --dry-run` prints it (``render_plan``) and `temper config show` prints the resolved
configuration with the source of every value (``render_config``): one path, so a mistake reads the
same in all three, naming the file, table and key.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from temper.runtime.config import ServiceConfig, describe_errors, field_sources, load_config, wiring
from temper.runtime.launcher import SERVICES, Launcher, config_class, dependencies, waves


def job_spec(table: dict, source: Path, steps: int = 0, seed: int | None = None):
    """The [job] table as a validated JobSpec; a user mistake is a ValueError naming table, key and allowed values."""
    from temper.runtime.errors import InvalidArgument
    from temper.scheduler.core import JobSpec

    from temper import tasks

    table = dict(table)
    table.pop("step_labels", None)  # `temper prm label`'s settings, not the scheduler's (step_label_settings)
    if isinstance(table.get("domain_config"), dict):  # dataset paths are relative to the job file's folder
        table["domain_config"] = tasks.resolve_paths(table["domain_config"], Path(source).parent)
    if steps:
        table["steps"] = steps
    if seed is not None:
        table["seed"] = seed
    allowed = [f.name for f in dataclasses.fields(JobSpec)]
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        named = ", ".join(f"job.{k}" for k in unknown)
        raise ValueError(f"{source}: [job] has unknown key(s) {named}; allowed: {', '.join([*allowed, 'step_labels'])}")
    try:
        spec = JobSpec.from_dict(table)
        spec.validate()
    except InvalidArgument as e:
        raise ValueError(f"{source}: [job] {e}") from None
    return spec


def step_label_settings(table: dict, source: Path) -> tuple[dict, dict]:
    """The [job.step_labels] table resolved (values, sources) as `temper prm label` uses it without flags; a
    mistake is a ValueError naming the file and ``job.step_labels.KEY``."""
    from temper.reward.step_labels import resolve_settings
    from temper.runtime.errors import InvalidArgument

    try:
        return resolve_settings(table.get("step_labels"), {})
    except InvalidArgument as e:
        raise ValueError(f"{source}: {e}") from None


@dataclass
class ServicePlan:
    name: str
    config: ServiceConfig
    sources: dict[str, str]  # field -> default | file | env TEMPER_... | flag --x (launcher) | launcher at start: ...
    needs: list[str]         # the services whose addresses it is started with


@dataclass
class Plan:
    config_path: Path
    home: Path
    table: dict[str, Any]        # the file as read
    spec: Any                    # temper.scheduler.core.JobSpec
    job_sources: dict[str, str]  # [job] key -> default | file | flag --steps / --seed
    model: Any                   # temper.models.ModelInfo (a tiny preset not built yet: named only)
    model_built: bool            # the folder holds a model now (a tiny preset is built at start otherwise)
    services: dict[str, ServicePlan] = field(default_factory=dict)
    waves: list[list[str]] = field(default_factory=list)
    start_timeout: float = 0.0
    job_timeout: float = 0.0
    runs: Path = Path("runs")
    step_labels: dict[str, Any] = field(default_factory=dict)         # [job.step_labels] resolved (temper prm)
    step_label_sources: dict[str, str] = field(default_factory=dict)  # key -> default | job.step_labels
    # domain -> (its most common held-out answer, the share of held-out problems it solves): what a policy gains
    # by learning to give that answer everywhere, without the skill
    majority: dict[str, tuple[str, float]] = field(default_factory=dict)


def make_plan(launcher: Launcher, steps: int = 0, seed: int | None = None, start_timeout: float = 0.0,
              job_timeout: float = 0.0, runs: str | Path = "runs") -> Plan:
    """Everything `temper run` checks before it starts anything; a user mistake is a ValueError (or
    InvalidArgument) naming the file, table and key."""
    from temper.models import check_service_tables, resolve_model
    from temper.models.resolve import TINY_MARKER
    from temper.runtime.errors import InvalidArgument
    from temper.scheduler.evaluation import majority_answers

    table = launcher.config()
    source = launcher.config_path
    job_table = table.get("job", {})
    spec = job_spec(job_table, source, steps, seed)
    step_labels, step_label_sources = step_label_settings(job_table, source)
    # refused before anything starts: held-out sets that overlap training, a model the job cannot use
    sets = spec.eval_sets()
    job_sources = {f.name: "file" if f.name in job_table else "default" for f in dataclasses.fields(spec)}
    if steps:
        job_sources["steps"] = "flag --steps"
    if seed is not None:
        job_sources["seed"] = "flag --seed"
    try:
        model = resolve_model(table.get("model"), home=launcher.home, build=False)
        check_service_tables(table, model.dir)
    except InvalidArgument as e:
        raise ValueError(f"{source}: {e}") from None
    if spec.chat_template and not (model.preset != "tiny" and model.has_chat_template):
        what = "the tiny recipe" if model.preset == "tiny" else f"the model {model.dir}"
        raise ValueError(f"{source}: job.chat_template: {what} has no chat template")
    built = (model.dir / TINY_MARKER).exists() if model.preset == "tiny" else True
    plan = Plan(source, launcher.home, table, spec, job_sources, model, built, waves=waves(list(SERVICES)),
                start_timeout=start_timeout, job_timeout=job_timeout, runs=Path(runs), step_labels=step_labels,
                step_label_sources=step_label_sources, majority=majority_answers(sets) if sets else {})
    errors = []
    for name in SERVICES:
        cls = config_class(name)
        argv = launcher.service_flags(name, table, model.dir, {}, "")
        try:
            config = load_config(cls, argv)
        except ValidationError as e:
            errors += describe_errors(cls, e, argv)
            continue
        sources = {k: ("flag (launcher)" if v.startswith("flag") else v) for k, v in field_sources(cls, argv).items()}
        own = table.get(name, {})
        for k, v in config.model_dump().items():  # a table naming some keys of a nested setting keeps the others
            if sources[k] == "file" and isinstance(v, dict) and isinstance(own[k], dict) and set(v) - set(own[k]):
                sources[k] = "file (keys it does not set: default)"
        sources["kafka_bootstrap"] = "launcher at start: the broker's address (a free port)"
        needs = sorted(dependencies(name))
        for field_name, w in wiring(cls).items():
            if "address_of" in w:
                sources[field_name] = f"launcher at start: the address {w['address_of']} reports"
        plan.services[name] = ServicePlan(name, config, sources, needs)
    if errors:
        raise ValueError(f"{source}: invalid configuration:\n  " + "\n  ".join(errors))
    return plan


# -- temper run --dry-run ------------------------------------------------------------------------
def _tiny_defaults() -> dict[str, Any]:
    """The tiny recipe's knobs and their defaults (``build_tiny_model``'s keyword defaults)."""
    import inspect

    from temper.models.resolve import TINY_KNOBS
    from temper.models.tiny import build_tiny_model

    params = inspect.signature(build_tiny_model).parameters
    return {k: params[k].default for k in TINY_KNOBS}


def _model_line(plan: Plan) -> str:
    m, knobs = plan.model, plan.table.get("model", {})
    if m.preset == "tiny":
        recipe = ", ".join(f"{k} {knobs.get(k, d)}" for k, d in _tiny_defaults().items())
        state = "built already" if plan.model_built else "built at start (not there yet)"
        return f"the tiny preset ({recipe}), a local Llama-architecture model; {m.dir}: {state}"
    return (f"{m.dir} (a model folder, used as it is): {m.architecture}, vocabulary {m.model_vocab_size}, context "
            f"{m.context_length or '?'}, EOS ids {list(m.eos_token_ids)}, chat template "
            f"{'yes' if m.has_chat_template else 'no'}")


def _domain_line(domain: str, config: dict | None) -> str:
    from temper import tasks

    described = tasks.describe(domain, config)  # a dataset: its file, rows, fields and verifier
    if described:
        extra = {k: v for k, v in sorted(config.items()) if k in ("instruction", "format") and v}
        return described + "".join(f"; {k} = {json.dumps(v)}" for k, v in extra.items())
    if config:
        return ", ".join(f"{k} = {json.dumps(v)}" for k, v in sorted(config.items()))
    return "the family's defaults"


def _reward_lines(plan: Plan) -> list[str]:
    """Per job domain, the composite reward the reward service will pay: its [reward.domains.X] and weights."""
    reward = plan.services["reward"].config
    by_spec: dict[str, list[str]] = {}
    specs = {}
    for d in [*plan.spec.domains, *(d for d in plan.spec.eval_domains if d not in plan.spec.domains)]:
        found = reward.domain_spec(d)
        key = found[0] if found else ""
        by_spec.setdefault(key, []).append(d)
        specs[key] = found[1] if found else None
    lines = []
    for key, domains in by_spec.items():
        spec = specs[key]
        paid = ("no [reward.domains] entry: not scored" if spec is None else
                f"[reward.domains.{key}] " + ", ".join(f"{c} {w:g}" for c, w in spec.weights.items()))
        lines.append(f"{', '.join(domains)}: {paid}")
    return lines


def _monitor_line(plan: Plan) -> str:
    """The detectors the monitor runs on the job's domains, each with its policy (warn | pause | stop)."""
    from temper.monitor.core import DetectorSet
    from temper.monitor.detectors import DETECTORS

    detectors = DetectorSet(plan.services["monitor"].config.detectors)
    domains = [*plan.spec.domains, *(d for d in plan.spec.eval_domains if d not in plan.spec.domains)]
    per_name: dict[str, dict[str, str]] = {name: {} for name in DETECTORS}
    for d in domains:
        for source in sorted({cls.source for cls in DETECTORS.values()}):
            for name, settings in detectors.for_domain(source, d):
                per_name[name][d] = settings.policy
    parts, off = [], []
    for name, by_domain in per_name.items():
        if not by_domain:
            off.append(name)
        elif len(set(by_domain.values())) == 1 and len(by_domain) == len(domains):
            parts.append(f"{name} {next(iter(by_domain.values()))}")
        else:
            parts.append(f"{name} " + "/".join(f"{p} on {d}" for d, p in by_domain.items()))
    return ("detectors (policy): " + ", ".join(parts) if parts else "no detector")\
        + (f"; off: {', '.join(off)}" if off else "")


def _sampling_lines(spec) -> list[str]:
    """How the scheduler draws: the [job.sampling] policies on, with their settings, and each domain's starting
    draw probability and curriculum level (the resolved plan, ``JobSpec.sampling_plan``)."""
    plan = spec.sampling_plan()
    policies, rows = plan["policies"], plan["domains"]
    settings = []
    for name, value in policies.items():
        if name in ("weights", "pass_threshold"):  # the two plain settings; every other key is a policy's table
            continue
        shown = {k: v for k, v in value.items() if k != "ladders" and v not in ([], {})}
        settings.append(name + (f" ({', '.join(f'{k} {json.dumps(v)}' for k, v in shown.items())})" if shown else ""))
    if settings:
        settings.append(f"a sample passes at reward >= {policies.get('pass_threshold', 1.0):g}")
    head = "; ".join(settings) if settings else "no [job.sampling] policy: domains drawn by their weights alone"
    probs = [r["weight"] for r in rows]
    if max(probs) - min(probs) < 1e-12:
        start = f"starting draw probability {probs[0]:.3g} for each of {len(rows)} domains"
    else:
        start = "starting draw probabilities " + ", ".join(f"{r['domain']} {r['weight']:.3g}" for r in rows)
    lines = [head, start]
    if "curriculum" in policies:
        lines += [f"{r['domain']}: curriculum level {r['difficulty']} of {r['levels']} ("
                  + (", ".join(f"{k} = {json.dumps(v)}" for k, v in sorted(r["options"].items())) or "its defaults")
                  + ")" for r in rows if r["levels"] > 1]
    return lines


def render_plan(plan: Plan) -> str:
    spec, s = plan.spec, plan.services
    inference, learner = s["inference"].config, s["learner"].config
    samples = spec.prompts_per_step * spec.group_size
    lines = [f"temper run --dry-run: the plan of {plan.config_path}; nothing was started",
             f"home      {plan.home} (state.json, logs/, data/); report: {plan.runs}/<time>/ and {plan.runs}/latest",
             f"model     {_model_line(plan)}",
             "services  the broker (Tansu, a free port), then in waves (a service starts once the addresses it "
             "needs are known):"]
    for i, wave in enumerate(plan.waves, 1):
        lines.append(f"            wave {i}: " + ", ".join(
            n + (f" (needs {', '.join(s[n].needs)})" if s[n].needs else "") for n in wave))
    lines += [f"          inference: engine {inference.engine}, dtype {inference.dtype}; learner: advantage "
              f"{learner.advantage}, policy loss {learner.policy_loss}, lr {learner.lr:g}, epochs {learner.epochs}, "
              f"device {learner.device}",
              f"job       {spec.steps} steps x {spec.prompts_per_step} prompts x {spec.group_size} samples (group_size) "
              f"= {samples} samples per step, {samples * spec.steps} in all; max policy lag {spec.max_policy_lag}; "
              f"temperature {spec.temperature:g}; max_tokens {spec.max_tokens}; seed {spec.seed}"
              + (f"; chat template, response prefix {spec.response_prefix!r}" if spec.chat_template else "")
              + (f"; stop at {', '.join(map(repr, spec.stop))}" if spec.stop else ""),
              "domains   " + "\n          ".join(
                  f"{d}" + ("" if d in spec.domains else " (eval only)") + ": " + _domain_line(d, spec.domain_config.get(d))
                  for d in [*spec.domains, *(d for d in spec.eval_domains if d not in spec.domains)])]
    if spec.adapters:
        lines.append("adapters  " + "\n          ".join(f"{name}: {', '.join(domains)}"
                                                    for name, domains in spec.adapters.items())
                     + "\n          (one LoRA adapter each over a frozen base; other domains: the base)")
    lines.append("sampling  " + "\n          ".join(_sampling_lines(spec)))
    lines.append("reward    " + "\n          ".join(_reward_lines(plan)))
    lines.append(f"monitor   {_monitor_line(plan)}")
    ev = spec.eval
    if ev.size > 0:
        extra = f"; eval-only: {', '.join(ev.extra_domains)}" if ev.extra_domains else ""
        when = f"every {ev.every} policy versions, " if ev.every else ""
        how = "greedy" if ev.temperature == 0 else f"{ev.answers} samples at T = {ev.temperature:g}"
        lines.append(f"eval      {ev.size} held-out problems per domain ({len(spec.eval_domains)} domains{extra}), "
                     f"seed {ev.seed}, {how}, "
                     f"{ev.max_tokens or spec.max_tokens} tokens max; before training, "
                     f"{when}and at the end")
        if plan.majority:
            lines.append("          most common answer (share of held-out problems it solves): " + ", ".join(
                f"{domain} {answer!r} {share:.0%}" for domain, (answer, share) in plan.majority.items()))
    else:
        lines.append("eval      none (job.eval.size = 0)")
    sl = plan.step_labels
    given = [k for k, v in plan.step_label_sources.items() if v != "default"]
    if given:  # a job that does not label steps gets no line about it
        if sl["delimiter"] is None:
            delimiter = "each domain's [reward] delimiter"
        elif isinstance(sl["delimiter"], str):
            delimiter = json.dumps(sl["delimiter"])
        else:
            delimiter = (", ".join(f"{d} {json.dumps(v)}" for d, v in sl["delimiter"].items())
                         + "; other domains: their [reward] delimiter")
        lines.append(f"labels    `temper prm label/grow` step labels: budget {sl['budget']} rollouts, k {sl['k']} per "
                     f"step prefix, {sl['label']} labels, threshold {sl['threshold']:g}, "
                     f"{sl['min_steps']}..{sl['max_steps']} steps, delimiter {delimiter} "
                     f"([job.step_labels] sets {', '.join(given)}; flags override)")
    job_timeout = f"{plan.job_timeout:g} s" if plan.job_timeout and math.isfinite(plan.job_timeout) else "none"
    lines.append(f"budget    start-up timeout {plan.start_timeout:g} s; job timeout {job_timeout} "
                 f"(--timeout, --job-timeout)")
    lines.append("every value: `temper config show` (same --config/--job)")
    return "\n".join(lines)


# -- temper config show --------------------------------------------------------------------------
def _key(k: str) -> str:
    return k if k and all(c.isalnum() or c in "_-" for c in k) and k.isascii() else _string(k)


def _string(v: str) -> str:
    return json.dumps(v).replace("\x7f", "\\u007f")


def toml_value(v: Any) -> str:
    """``v`` (None, bool, int, float, str, list, dict of these) as a TOML value; a dict as an inline table."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return ("inf" if v > 0 else "-inf") if math.isinf(v) else "nan" if math.isnan(v) else repr(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(str(k))} = {toml_value(x)}" for k, x in v.items() if x is not None) + "}"
    raise TypeError(f"no TOML form for {type(v).__name__}")


def toml_table(path: list[str], values: dict[str, Any], notes: dict[str, str] | None = None,
               header_note: str = "") -> list[str]:
    """``values`` as the TOML table ``[path]``: plain keys first (each with its note as a comment), then a
    non-empty dict value as a sub-table ``[path.key]`` (recursively). None has no TOML form: a comment says so."""
    notes = notes or {}
    head = "[" + ".".join(_key(p) for p in path) + "]"
    lines = [head + (f"  # {header_note}" if header_note else "")]
    subtables = []
    for k, v in values.items():
        note = notes.get(k, "")
        if v is None:
            lines.append(f"# {_key(k)} is unset" + (f"  ({note})" if note else ""))
        elif isinstance(v, dict) and any(isinstance(x, dict) for x in v.values()):
            subtables.append((k, v, note))
        else:
            lines.append(f"{_key(k)} = {toml_value(v)}" + (f"  # {note}" if note else ""))
    for k, v, note in subtables:
        lines += ["", *toml_table([*path, k], v, header_note=note)]
    return lines


def render_config(plan: Plan) -> str:
    """The fully resolved configuration as TOML, every value's source in a comment."""
    out = [f"# temper config show: {plan.config_path}, resolved as `temper run` starts it (home {plan.home})",
           "# sources, highest priority first: flag (launcher) = set by the launcher on the command line; launcher",
           "# at start = known once the broker/service is up (the value shown is the config's, replaced then);",
           "# env TEMPER_<SERVICE>_<FIELD>; file = this file's [<service>] table; default = the config class's",
           "# (services/temper/<service>/config.py). --log-level sets TEMPER_<SERVICE>_LOG_LEVEL.",
           ""]
    job = dataclasses.asdict(plan.spec)
    job.pop("job_id")
    out += toml_table(["job"], job, plan.job_sources)
    notes = {k: "file" if v == "job.step_labels" else v for k, v in plan.step_label_sources.items()}
    if plan.step_labels["delimiter"] is None:
        notes["delimiter"] += ": each domain's [reward.domains.NAME].step_delimiter, else [reward].prm_step_delimiter"
    out += ["", *toml_table(["job", "step_labels"], plan.step_labels, notes,
                            header_note="temper prm label / grow; their flags override")]
    model_table = dict(plan.table.get("model", {}))
    notes = {k: "file" for k in model_table}
    if plan.model.preset == "tiny":
        for k, d in _tiny_defaults().items():
            if k not in model_table:
                model_table[k], notes[k] = d, "default"
        if "dir" not in notes:
            notes["dir"] = "the tiny preset's folder in the home"
        notes["dir"] += ", built already" if plan.model_built else ", built at start"
    model_table["dir"] = str(plan.model.dir)
    out += ["", *toml_table(["model"], model_table, notes)]
    for name in SERVICES:
        sp = plan.services[name]
        values = sp.config.model_dump(mode="json")
        out += ["", *toml_table([name], values, sp.sources,
                                header_note=f"starts in wave {next(i for i, w in enumerate(plan.waves, 1) if name in w)}")]
    return "\n".join(out) + "\n"
