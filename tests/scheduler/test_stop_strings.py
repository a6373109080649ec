"""``[job] stop``: strings that end an answer, from the job table to the JobSpec message and back; bad
values refused naming the field."""

import pytest

from temper.runtime.errors import InvalidArgument
from temper.scheduler.core import MAX_STOP_STRINGS, JobSpec


def test_stop_strings_travel_from_the_job_table_through_the_message():
    spec = JobSpec.from_dict({"domains": ["chain.add_sub"], "max_tokens": 32, "stop": ["\n\n", "Start with"]})
    spec.validate()
    back = JobSpec.from_proto(spec.to_proto())
    assert back.stop == ["\n\n", "Start with"]
    assert JobSpec.from_proto(JobSpec.from_dict({}).to_proto()).stop == []  # none by default


@pytest.mark.parametrize("stop", [[""], ["x" * 257], ["\n"] * (MAX_STOP_STRINGS + 1), "\n\n", [3]])
def test_bad_stop_strings_are_refused_naming_the_field(stop):
    with pytest.raises(InvalidArgument) as e:
        JobSpec.from_dict({"stop": stop}).validate()
    assert e.value.field == "stop"
