"""Cut a run's summary.json (``temper run``'s report) down to what the detector figures replay.

    python tests/monitor/data/extract_summary.py RUN/summary.json tests/monitor/data/NAME.json [SAMPLES]

Kept: the job's shape and config, per step the learner's StepMetrics values (those in METRICS_KEPT), the per-domain mean
rewards and the sample completions (with their reward components); dropped: everything else
(evaluations, sampling tables, the policy's path, prompts). SAMPLES: keep at most that many samples
per step (default: all the summary has).
"""

import json
import sys

# the learner metrics the training_signal detector reads, and a few that explain them
METRICS_KEPT = {"kl_ref", "entropy", "clip_fraction", "approx_kl", "kl_coef", "grad_norm", "loss", "tokens",
                "advantage_std", "ratio_mean", "lr"}


def extract(summary: dict, samples: int | None = None) -> dict:
    job = summary["config"]["job"]
    return {
        "source": "summary.json of a real `temper run` (see extract_summary.py)",
        "job_id": summary["job"]["job_id"],
        "model": summary.get("model_dir", ""),
        "job": {k: job[k] for k in ("steps", "prompts_per_step", "group_size", "domains", "temperature",
                                    "max_tokens") if k in job},
        "reward": summary["config"].get("reward", {}),
        "monitor": summary["config"].get("monitor", {}),
        "job_state": summary.get("job_state", ""),
        "alerts_raised": [{k: a.get(k) for k in ("detector", "domain", "step", "message")}
                          for a in summary.get("alerts", [])],
        "steps": [{**{k: s[k] for k in ("step", "mean_reward", "samples", "policy_version", "domain_mean_reward")},
                   "values": {k: v for k, v in s["values"].items() if k in METRICS_KEPT}} for s in summary["steps"]],
        "samples": {step: [{k: t[k] for k in ("trajectory_id", "domain", "reference", "completion", "reward",
                                              "components")} for t in ts[:samples]]
                    for step, ts in summary.get("samples", {}).items()},
    }


if __name__ == "__main__":
    src, dst = sys.argv[1:3]
    with open(src) as f:
        out = extract(json.load(f), int(sys.argv[3]) if len(sys.argv) > 3 else None)
    with open(dst, "w") as f:
        json.dump(out, f, sort_keys=True, separators=(",", ":"))
