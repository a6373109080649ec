"""``temper prm label``: Math-Shepherd step labels for a job's exported trajectories, through the real
inference and reward services (``temper.reward.step_labels`` has the method; this wires it).

  python -m temper.reward.dataset --kafka-bootstrap HOST:PORT --out export.jsonl   # the job's scored stream
  temper prm label --from export.jsonl --out labels.jsonl --k 4 --budget 256 [--job NAME | --config FILE]

The labelling settings (k, budget, label, threshold, min_steps, max_steps, delimiter) come from the job's
``[job.step_labels]`` table, each overridden by its flag when given (``label_settings``); the summary
(and grow.json) records them with their sources, every record's provenance the budget and k it was made with.
  python -m temper.reward.train --data labels.jsonl --base POLICY --out prm/        # the PRM trainer reads them
  temper prm grow --from export.jsonl --out grown/ --register   # all of it, then LoadModel into the running stack

Rollouts go to the inference service of ``--home``'s stack when it is up (the job's current policy),
else to inference and reward services started for this command from the job's config (``--model DIR``:
another policy folder, e.g. a run's exported policy). Each rollout prompt is the task's prompt as the
job encoded it (chat template, response prefix) followed by the token ids of the completion's prefix,
so the policy continues exactly the text the labelled steps show.
"""

from __future__ import annotations

import codecs
import contextlib
import itertools
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

from temper.runtime.jsonl import jsonl_rows

MAX_SEQUENCES_PER_CALL = 512  # rollouts per Generate call (well under the service's max_sequences_per_request)
MAX_GROUP = 256  # completions per Score call (under the reward service's max_group_size)
TEMPORARY = "services started for this command"
LIVE = "scored"  # --from scored: the running stack's topic


def read_export(path: Path, max_trajectories: int = 0) -> list:
    """The outcome records of a dataset export that carry their task, as ``Sampled`` trajectories."""
    from temper.reward.step_labels import Sampled

    if not path.is_file():
        raise ValueError(f"--from: no such file {path}")
    out, without_task = [], 0
    with open(path) as f:
        for *_, rec in jsonl_rows(f, lambda _, n, e: ValueError(f"--from: {path}:{n}: not JSON: {e}")):
            if not isinstance(rec, dict) or "completion" not in rec:
                continue  # preference pairs, process records
            if not isinstance(rec.get("task"), dict) or not rec["task"].get("domain"):
                without_task += 1
                continue
            out.append(Sampled.from_record(rec))
    if not out:
        raise ValueError(f"--from: {path} has no outcome record with its task"
                         + (f" ({without_task} without one: export again with `python -m temper.reward.dataset`, "
                            "which writes each record's task)" if without_task else ""))
    return out[:max_trajectories] if max_trajectories > 0 else out


def export_live(launcher, path: Path, job_id: str = "") -> Path:
    """Export the topics of ``launcher``'s running stack to ``path`` (``temper.reward.dataset.export``: scored
    groups with their execution traces joined), only job ``job_id``'s when given; the path."""
    from temper.reward.dataset import export

    state = launcher.load()
    if state is None or state.broker is None:
        raise ValueError(f"--from {LIVE}: no running stack in {launcher.home} (start one with `temper up`, or "
                         "pass an export file)")
    path.parent.mkdir(parents=True, exist_ok=True)
    if not export(state.kafka_bootstrap, path, job_id=job_id)["groups"]:
        raise ValueError(f"--from {LIVE}: the stack's scored topic has no group"
                         + (f" of job {job_id!r}" if job_id else "") + " yet")
    return path


def label_settings(args, job: dict) -> tuple[dict, dict]:
    """(values, sources) of the labelling settings: each flag given, else the job's ``[job.step_labels]``, else
    the built-in default (``temper.reward.step_labels.resolve_settings``); --delimiter's backslash escapes
    read ("\\n" is a newline; a TOML string has its own escapes)."""
    from temper.reward.step_labels import LABEL_DEFAULTS, resolve_settings

    flags = {key: getattr(args, key) for key in LABEL_DEFAULTS if key != "delimiter"}
    raw = args.delimiter
    flags["delimiter"] = codecs.decode(raw, "unicode_escape") if raw is not None and "\\" in raw else raw
    return resolve_settings(job.get("step_labels"), flags)


def delimiter_option(value, config_path: Path):
    """The step delimiter: ``value`` when a string; else each domain's own, from ``value`` when a table
    domain -> delimiter naming it, else from the job's [reward] tables (``[reward.domains.NAME].step_delimiter``,
    else ``prm_step_delimiter``): the split the reward service's PRM uses."""
    if isinstance(value, str):
        return value
    from temper.reward.config import RewardConfig
    from temper.runtime.config import load_config

    settings = load_config(RewardConfig, ["--config", str(config_path)]).reward_settings()
    given = value or {}

    def of(domain: str) -> str:
        if domain in given:
            return given[domain]
        found = settings.domain_spec(domain)
        return found[1].step_delimiter or settings.prm_step_delimiter if found else settings.prm_step_delimiter

    return of


@contextlib.contextmanager
def services(args, launcher, needs_sandbox: bool) -> Iterator[tuple[str, str, Path, str]]:
    """(inference address, reward address, policy folder, where): the stack of ``--home`` when its inference
    and reward are SERVING, else both started for this command (and stopped after it)."""
    from temper.cli.main import _ModelLauncher
    from temper.runtime.launcher import Launcher
    from temper.runtime.rpc import check_health

    state = launcher.load()
    procs = state.services if state else {}
    if all(n in procs and check_health(procs[n].address) == "SERVING" for n in ("inference", "reward")):
        model_dir = Path(args.model) if args.model else launcher._model_dir(launcher.config())
        yield procs["inference"].address, procs["reward"].address, model_dir, f"the stack in {launcher.home}"
        return
    with tempfile.TemporaryDirectory(prefix="temper-prm-") as home:
        temp = (_ModelLauncher(home, launcher.config_path, args.model) if args.model
                else Launcher(home=home, config=launcher.config_path))
        state = temp.up(["inference", "reward"] + (["sandbox"] if needs_sandbox else []), timeout=args.timeout)
        try:
            yield (state.services["inference"].address, state.services["reward"].address,
                   temp._model_dir(temp.config()), TEMPORARY)
        finally:
            temp.down()


def _label(args, out: Path, keep_policy: Path | None = None) -> tuple[dict, list[dict]]:
    """Labels ``--from`` into ``out`` (JSON lines); the run's summary and its records. ``keep_policy``: where
    to copy the policy folder when it lives in this command's own stack (gone once the stack stops)."""
    from temper.cli.main import _launcher
    from temper.reward.step_labels import LabelOptions, check_delimiters, field_of

    launcher = _launcher(args)
    job = launcher.config().get("job", {})
    # every refusal (a budget of 0, a bad [job.step_labels] key, a delimiter that never occurs, ...) before
    # anything heavy loads or starts
    settings, sources = label_settings(args, job)
    source = Path(args.from_)
    if args.from_job and args.from_ != LIVE:
        raise ValueError(f"--from-job: only with --from {LIVE} (an export file holds what it was exported with)")
    if args.from_ == LIVE:  # the running stack's scored topic: every job's trajectories so far (--from-job: one's)
        source = export_live(launcher, out.with_name(out.stem + ".export.jsonl"), args.from_job)
    trajectories = read_export(source, args.max_trajectories)
    options = LabelOptions(k=settings["k"], budget=settings["budget"],
                           delimiter=delimiter_option(settings["delimiter"], launcher.config_path),
                           threshold=settings["threshold"], label_kind=settings["label"],
                           min_steps=settings["min_steps"], max_steps=settings["max_steps"])
    check_delimiters(trajectories, options, field_of(sources)("delimiter"))
    import grpc
    from transformers import AutoTokenizer

    from temper.client.sdk import InferenceClient, RewardClient
    from temper.inference.engine import encode_prompt
    from temper.reward.dataset import LEARNED, verifier_label
    from temper.reward.step_labels import Rollout, Rollouts, Verdict, label
    from temper.v1 import common_pb2

    chat = bool(job.get("chat_template", False)) if args.chat_template is None else args.chat_template
    max_tokens = args.max_tokens or int(job.get("max_tokens", 64))
    temperature = float(job.get("temperature", 1.0)) if args.temperature is None else args.temperature
    stop = list(job.get("stop", []))  # a rollout ends as the job's answers do
    code = any(s.task.domain.startswith("code.") or s.task.metadata.get("verifier", "").startswith("code.")
               for s in trajectories)
    out.parent.mkdir(parents=True, exist_ok=True)
    with services(args, launcher, code) as (inference_address, reward_address, model_dir, where), \
            InferenceClient(inference_address, timeout=3600) as inference, RewardClient(reward_address) as reward:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)

        calls = itertools.count()  # each Generate call its own seed: the same prefix in two trajectories gets fresh samples

        def generate(task: common_pb2.Task, prefixes: list[str], k: int) -> Rollouts:
            base = encode_prompt(tokenizer, task.prompt, chat, "prompt", task.metadata.get("response_prefix", ""))
            prompts = [base + list(tokenizer(p, add_special_tokens=False).input_ids) for p in prefixes]
            per_prefix, version = [], 0
            step = max(1, MAX_SEQUENCES_PER_CALL // k)
            for i in range(0, len(prompts), step):
                resp = inference.generate(prompts[i: i + step], n=k, temperature=temperature, max_tokens=max_tokens,
                                          stop=stop, seed=args.seed * 1_000_003 + next(calls))
                version = resp.policy_version
                per_prefix += [[Rollout(c.text, c.finish_reason, tuple(c.token_ids)) for c in r.completions]
                               for r in resp.results]
            return Rollouts(per_prefix, version)

        def score(task: common_pb2.Task, completions: list[Rollout]) -> list[Verdict]:
            verdicts = []
            for i in range(0, len(completions), MAX_GROUP):
                group_id = f"prm-label/{task.task_id}/{i}"
                group = common_pb2.RolloutGroup(group_id=group_id, task=task, trajectories=[
                    common_pb2.Trajectory(trajectory_id=f"{group_id}/{j}", group_id=group_id, completion_text=c.text,
                                          finish_reason=c.finish_reason, completion_token_ids=c.token_ids)
                    for j, c in enumerate(completions[i: i + MAX_GROUP])])
                try:
                    scored = reward.score(group)
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.INVALID_ARGUMENT:
                        raise RuntimeError(f"reward service: {e.code().name}: {e.details()}") from None
                    return [Verdict(None, f"refused: {e.details()}")] * len(completions)
                for t in scored.trajectories:
                    used = sorted(c.name for c in t.reward.components if c.name not in LEARNED and c.weight > 0)
                    ok = t.reward.status == common_pb2.REWARD_STATUS_OK
                    verdicts.append(Verdict(verifier_label(t.reward) if ok else None, ",".join(used)))
            return verdicts

        run = label(trajectories, generate, score, options, seed=args.seed,
                    log=(lambda line: print(line, flush=True)) if args.verbose else None)
        if keep_policy is not None and where == TEMPORARY and not args.model:
            import shutil

            model_dir = Path(shutil.copytree(model_dir, keep_policy))
    with open(out, "w") as f:
        for rec in run.records:
            f.write(json.dumps(rec) + "\n")
    used = {**settings, "delimiter": options.delimiter if isinstance(options.delimiter, str)
            else {d: options.delimiter_of(d) for d in sorted({s.task.domain for s in trajectories})}}
    summary = {**run.summary(options.budget), "out": str(out), "from": str(args.from_), "k": options.k,
               "label": options.label_kind, "model": str(model_dir), "via": where, "trajectories": len(trajectories),
               "settings": used, "settings_sources": sources}
    return summary, run.records


def cmd_prm_label(args) -> int:
    summary, records = _label(args, Path(args.out))
    print(json.dumps(summary))
    return 0 if records else 2


def cmd_prm_grow(args) -> int:
    """label -> split by task -> train (temper.reward.train) -> step accuracy / AUC on the held-out tasks
    -> with --register, LoadModel into the running reward service (``temper.cli.reward``)."""
    from temper.runtime.errors import require

    require(0 < args.heldout < 1, "--heldout", f"a fraction in (0, 1), got {args.heldout}")
    require(args.epochs >= 1, "--epochs", f"must be >= 1, got {args.epochs}")
    out = Path(args.out)
    require(not out.exists() or not any(out.iterdir()), "--out", f"{out} is not empty")
    if args.base:
        from temper.models import check_model_dir

        check_model_dir(Path(args.base), field="--base")
    if args.register:  # the stack that gets the PRM must be up before any labelling starts
        from temper.cli.reward import reward_address

        register_at = reward_address(args, field="--register")
    summary, records = _label(args, out / "labels.jsonl", keep_policy=out / "policy")
    if len({r["task_id"] for r in records}) < 2:
        raise ValueError(f"labelled {len(records)} trajectories of fewer than 2 tasks: nothing to hold out "
                         "(raise the budget: --budget or [job.step_labels] budget; or give more trajectories)")

    from temper.reward.models import RewardModelEngine
    from temper.reward.step_labels import split_heldout, step_accuracy, step_auc
    from temper.reward.train import train

    train_set, heldout = split_heldout(records, args.heldout, args.seed)
    for name, rows in (("train", train_set), ("heldout", heldout)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    trained = train([out / "train.jsonl"], args.base or summary["model"], out / "prm", epochs=args.epochs, lr=args.lr,
                    seed=args.seed, log=lambda line: print(line, flush=True))
    engine = RewardModelEngine(out / "prm")
    try:
        scores = [s for r in heldout for s in engine.score_steps(r["prompt"], r["steps"])]
    finally:
        engine.close()
    labels = [y for r in heldout for y in r["hard_labels"]]
    evaluation = {"heldout_trajectories": len(heldout), "heldout_steps": len(labels),
                  "step_accuracy": step_accuracy(scores, labels), "step_auc": step_auc(scores, labels),
                  "positive_fraction": sum(y > 0.5 for y in labels) / len(labels) if labels else None}
    result = {"label": summary, "train": {"trajectories": len(train_set), "loss_per_epoch": trained["loss_per_epoch"]},
              "eval": evaluation, "prm": str((out / "prm").resolve())}
    if args.register:
        from temper.cli.reward import load_model

        try:
            result["register"] = load_model(register_at, out / "prm", "prm")
        except (ValueError, RuntimeError) as e:  # the PRM and its evaluation stay on disk, with why it is not serving
            result["register"] = {"error": str(e)}
    else:
        result["register"] = f"not registered: `temper reward load --prm {result['prm']}` loads it into the running " \
                             "reward service (or grow with --register)"
    (out / "grow.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 1 if "error" in result["register"] else 0


def add_commands(sub, command, common) -> None:
    """``temper prm ...`` under the top-level parser's subcommands (``command`` makes one; ``common``: the
    global options' parent parser)."""

    prm = sub.add_parser("prm", help="process reward models: step labels from a job's rollouts", parents=[common])
    prmsub = prm.add_subparsers(dest="prm_command", required=True)
    la = command("label", cmd_prm_label, "Math-Shepherd step labels: roll out k completions from each step prefix "
                 "of exported trajectories, label each step by the fraction (soft) / existence (hard) correct",
                 into=prmsub)
    la.add_argument("--out", required=True, help="JSON-lines process records for python -m temper.reward.train")
    _label_options(la)
    gr = command("grow", cmd_prm_grow, "label, train a PRM on the labels (temper.reward.train), report its step "
                 "accuracy / AUC on held-out tasks", into=prmsub)
    gr.add_argument("--out", required=True, help="a new folder: labels, train/heldout split, prm/, grow.json")
    gr.add_argument("--base", default="", help="model folder the PRM starts from (default: the policy)")
    gr.add_argument("--heldout", type=float, default=0.25, help="fraction of the labelled tasks held out")
    gr.add_argument("--epochs", type=int, default=3)
    gr.add_argument("--lr", type=float, default=1e-3)
    gr.add_argument("--register", action="store_true", help="load the trained PRM into the reward service of the "
                    "running stack (--home) without a restart, as `temper reward load --prm` does")
    gr.add_argument("--address", default="", help="with --register: the reward service's HOST:PORT (default: the "
                    "stack of --home)")
    _label_options(gr)


def _label_options(la) -> None:
    import argparse

    from temper.reward.step_labels import LABEL_DEFAULTS as D

    la.add_argument("--from", dest="from_", required=True,
                    help=f"a dataset export (python -m temper.reward.dataset), or {LIVE!r}: the scored topic of the "
                         "running stack of --home (exported beside --out first)")
    la.add_argument("--from-job", default="", help=f"with --from {LIVE}: only this job's trajectories")
    # the labelling settings: a flag given overrides the job's [job.step_labels]; neither: the default shown
    la.add_argument("--k", type=int, default=None, help=f"rollouts per step prefix (default {D['k']})")
    la.add_argument("--budget", type=int, default=None, help="most rollouts of this run (a trajectory of S steps "
                    f"costs k x (S - 1)); default {D['budget']}")
    la.add_argument("--delimiter", default=None, help='step delimiter, escapes read ("\\n"); default: each '
                    "domain's [reward.domains.NAME].step_delimiter, else [reward].prm_step_delimiter")
    la.add_argument("--label", default=None, choices=["soft", "hard"], help="what step_labels holds (both are "
                    f"kept); default {D['label']}")
    la.add_argument("--threshold", type=float, default=None, help="a completion is correct when its verifier label "
                    f"is >= this (default {D['threshold']})")
    la.add_argument("--min-steps", type=int, default=None,
                    help=f"trajectories with fewer steps are skipped (default {D['min_steps']})")
    la.add_argument("--max-steps", type=int, default=None,
                    help=f"trajectories with more steps are skipped (default {D['max_steps']})")
    la.add_argument("--max-trajectories", type=int, default=0, help="read at most this many from --from (0: all)")
    la.add_argument("--job", default=None, help="take the services' config, the sampling settings and "
                    "[job.step_labels] from this shipped job (--config FILE: from that file)")
    la.add_argument("--model", default="", help="policy folder to roll out with (default: the job's model, or the "
                    "running stack's policy)")
    la.add_argument("--max-tokens", type=int, default=0, help="per rollout (default: the job's max_tokens)")
    la.add_argument("--temperature", type=float, default=None, help="(default: the job's temperature)")
    la.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                    help="the prompt in the model's chat template (default: the job's chat_template)")
    la.add_argument("--seed", type=int, default=0, help="the order trajectories are labelled in, and sampling")
    la.add_argument("--timeout", type=float, default=300.0, help="start-up timeout, seconds")
    la.add_argument("--verbose", action="store_true", help="a line per labelled trajectory")
