"""A hundred domains in one job: the [job.sampling] plan resolves (reasoning-gym's own difficulty ladders),
and the job schedules steps over them, learning each domain's outcomes."""

import json
import tomllib

from temper import tasks
from temper.scheduler.core import JobSpec
from tests.scheduler.test_sampling import scripted_job


def hundred_domain_job() -> dict:
    slow = {"rg.sokoban", "rg.jugs"}  # seconds per generated puzzle: a unit test leaves them out
    families = sorted(d for d in tasks.domains() if d.startswith("rg.") and d not in slow)[:100]
    text = f"""
[job]
steps = 2
prompts_per_step = 50
group_size = 4
domains = {json.dumps(families)}
seed = 7

[job.sampling]
weights = {{ "rg.chain_sum" = 3.0, "rg.basic_arithmetic" = 2.0 }}

[job.sampling.curriculum]
window = 2
raise_above = 0.7
lower_below = 0.2

[job.sampling.adaptive]
window = 4
floor = 0.002
"""
    return tomllib.loads(text)["job"]


def test_a_hundred_domain_job_resolves_its_plan_and_schedules():
    spec = JobSpec.from_dict(hundred_domain_job())
    plan = spec.sampling_plan()
    assert len(plan["domains"]) == 100
    assert abs(sum(d["weight"] for d in plan["domains"]) - 1) < 1e-9
    by = {d["domain"]: d for d in plan["domains"]}
    assert by["rg.chain_sum"]["weight"] > by["rg.basic_arithmetic"]["weight"] > by["rg.gcd"]["weight"]
    laddered = [d for d in plan["domains"] if d["levels"] > 1]
    assert len(laddered) >= 90  # nearly every family brings a curriculum of its own
    json.dumps(plan)  # plain data
    # every sample right: each domain drawn twice at a level climbs it
    job, published = scripted_job(spec, lambda task, k: True)
    for step in range(spec.steps):
        job.run_step(step)
        for g in published[step * spec.prompts_per_step:]:
            scored = type(g)()
            scored.CopyFrom(g)
            for t in scored.trajectories:
                t.reward.status, t.reward.total = 1, 1.0
            job.observe_scored(scored)
    assert len(published) == 2 * 50
    status = job.status()
    assert len(status.domains) == 100 and status.groups_scored == 2 * 50
    assert len({g.task.domain for g in published}) > 30
    assert sum(d.groups for d in status.domains) == 2 * 50
    assert any(d.difficulty >= 1 for d in status.domains)
    assert abs(sum(d.weight for d in status.domains) - 1) < 1e-9
