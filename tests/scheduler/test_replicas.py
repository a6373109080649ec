"""The serving version over inference replicas (temper.scheduler.replicas)."""

from __future__ import annotations

import pytest

from temper.scheduler.replicas import ReplicaMismatch, lowest_version
from temper.v1 import inference_pb2


def _info(version, vocab=64, lineage="run-a", model="m"):
    return inference_pb2.GetPolicyVersionResponse(policy_version=version, vocab_size=vocab, lineage=lineage,
                                                  model=model)


def test_the_serving_version_is_the_lowest_replicas():
    assert lowest_version({"a:1": _info(5), "b:1": _info(4), "c:1": _info(5)}) == 4
    # a replica never updated (the base model, no lineage yet) is behind, not foreign
    assert lowest_version({"a:1": _info(3), "b:1": _info(0, lineage="")}) == 0


def test_another_models_vocabulary_names_the_replica():
    with pytest.raises(ReplicaMismatch, match=r"replica b:1 serves a vocabulary of 99 tokens, the others 64") as e:
        lowest_version({"a:1": _info(2), "b:1": _info(2, vocab=99, model="other"), "c:1": _info(2)})
    assert e.value.field == "replica b:1"


def test_another_lineage_names_the_replica():
    with pytest.raises(ReplicaMismatch, match=r"replica c:1 serves version 9 of lineage run-b"):
        lowest_version({"a:1": _info(2), "b:1": _info(2), "c:1": _info(9, lineage="run-b")})


def test_no_replica_answered():
    with pytest.raises(ValueError):
        lowest_version({})
