"""The learner and its inference replicas without servers: real HF engines and servicers behind in-process clients.

Each push stores the version (policy_dir) before it reaches the replicas; a replica that reads the same
policy_dir installs it by reference, one that does not is streamed the chunks; a replica that is behind
(restarted, missed a push) is brought to the learner's version; one of another lineage or model is
named and never pushed to; an engine started from the store serves the learner's version."""

from __future__ import annotations

import grpc
import pytest
import torch

from temper.inference import policy_store
from temper.inference.engine import SamplingParams, build_engine
from temper.inference.servicer import InferenceServicer
from temper.inference.weights import decode_chunk
from temper.learner.loop import LearnerLoop
from temper.learner.trainer import Trainer, TrainerConfig
from temper.models.tiny import build_tiny_model
from temper.runtime.errors import FailedPrecondition, TemperError
from temper.runtime.rpc import _details
from temper.v1 import inference_pb2


class _Down(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "down"


class _Refused(grpc.RpcError):
    """What the server's error mapping answers for a TemperError (temper.runtime.rpc)."""

    def __init__(self, e: TemperError):
        self._code, self._details = e.code, _details(e)

    def code(self):
        return self._code

    def details(self):
        return self._details


class _Internal(grpc.RpcError):
    def __init__(self, e: Exception):
        self._details = f"internal error: {type(e).__name__}: {e}"

    def code(self):
        return grpc.StatusCode.INTERNAL

    def details(self):
        return self._details


class Replica:
    """An InferenceClient's surface over a real engine and servicer, in process; ``policy_dir``: the folder it
    reads stored versions from (the learner's, as on one host, or another one, as on another host)."""

    def __init__(self, address, model_dir, policy_dir=""):
        self.address = address
        self.engine = build_engine("hf", model_dir, seed=0)
        self.servicer = InferenceServicer(self.engine, 4 << 20, model_name=str(model_dir), policy_dir=str(policy_dir))
        self.down = False
        self.pushes = self.by_reference = self.refused = 0

    def info(self):
        if self.down:
            raise _Down()
        return self.servicer.GetPolicyVersion(inference_pb2.GetPolicyVersionRequest(), None)

    def update_weights(self, chunks):
        if self.down:
            raise _Down()
        chunks = [decode_chunk(c) if isinstance(c, bytes) else c for c in chunks]  # as the server reads them
        try:
            response = self.servicer.UpdateWeights(iter(chunks), None)
        except TemperError as e:
            self.refused += 1
            raise _Refused(e) from e
        except Exception as e:  # what the server's error mapping answers for anything else: INTERNAL
            self.refused += 1
            raise _Internal(e) from e
        self.pushes += 1
        self.by_reference += bool(chunks[0].stored_id)
        return response

    def close(self):
        self.engine.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m"), seed=0)


@pytest.fixture
def replicas(model_dir):
    made = [Replica(f"127.0.0.1:{9000 + i}", model_dir) for i in range(2)]
    yield made
    for r in made:
        r.close()


def _loop(model_dir, replicas, policy_dir):
    trainer = Trainer(model_dir, TrainerConfig())
    return LearnerLoop(trainer, None, replicas, None, 2, policy_dir=policy_dir)


def test_every_push_is_stored_first_and_a_behind_replica_catches_up(model_dir, replicas, tmp_path):
    loop = _loop(model_dir, replicas, tmp_path / "policy")
    a, b = replicas
    b.down = True  # misses the push of version 1
    loop.trainer.policy_version = 1
    loop._push(1)
    assert policy_store.latest(tmp_path / "policy") == {"version": 1, "lineage": loop.lineage,
                                                        "file": "v00000001.safetensors"}
    assert a.engine.policy_version == 1 and a.engine.lineage == loop.lineage
    assert b.engine.policy_version == 0 and loop.state.push_failures == 1
    b.down = False
    assert loop.sync_replicas() == [b.address]  # behind: pushed the current version
    assert b.engine.policy_version == 1 and b.engine.lineage == loop.lineage and a.pushes == 1
    assert loop.sync_replicas() == []  # nothing behind now: nothing pushed
    for v in (2, 3):
        loop.trainer.policy_version = v
        loop._push(v)
    assert sorted(p.name for p in (tmp_path / "policy").glob("v*.safetensors")) == \
        ["v00000002.safetensors", "v00000003.safetensors"]  # the two newest kept


def test_an_engine_started_from_the_store_serves_the_learners_version(model_dir, replicas, tmp_path):
    loop = _loop(model_dir, replicas, tmp_path / "policy")
    with torch.no_grad():
        next(loop.trainer.model.parameters()).add_(0.5)  # weights that differ from the base model's
    loop.trainer.policy_version = 4
    loop._push(4)
    tensors, version, lineage = policy_store.read(tmp_path / "policy")
    fresh = Replica("127.0.0.1:9100", model_dir)  # what InferenceService.open does before SERVING
    try:
        fresh.engine.apply_weights(tensors, version, lineage)
        assert (fresh.engine.policy_version, fresh.engine.lineage) == (4, loop.lineage)
        prompt = [[2, 5, 6]]
        params = SamplingParams(n=1, temperature=0.0, max_tokens=3)
        same, v1 = fresh.engine.generate(prompt, params)
        pushed, v2 = replicas[0].engine.generate(prompt, params)
        assert v1 == v2 == 4
        assert same[0].completions[0].logprobs == pytest.approx(pushed[0].completions[0].logprobs, abs=1e-5)
    finally:
        fresh.close()


def test_a_replica_of_another_lineage_is_named_and_never_pushed_to(model_dir, replicas, tmp_path):
    other = _loop(model_dir, replicas[1:], None)  # another training run owns replica b
    other.trainer.policy_version = 7
    other._push(7)
    loop = _loop(model_dir, replicas, tmp_path / "policy")
    assert loop.sync_replicas() == []
    error = loop.state.replica_errors[replicas[1].address]
    assert f"inference replica {replicas[1].address} serves version 7 of lineage {other.lineage}" in error
    loop.trainer.policy_version = 8
    loop._push(8)
    assert replicas[1].engine.lineage == other.lineage and replicas[1].pushes == 1  # left alone
    assert replicas[0].engine.policy_version == 8
    # and the engine itself refuses another lineage's update, naming the field
    with pytest.raises(FailedPrecondition, match=f"serves version 7 of lineage {other.lineage}") as e:
        replicas[1].engine.apply_weights(loop.trainer.push_weights(), 9, loop.lineage)
    assert e.value.field == "lineage"


def test_a_replica_of_a_larger_vocabulary_is_named(model_dir, replicas, tmp_path):
    loop = _loop(model_dir, replicas, tmp_path / "policy")
    replicas[0].engine.vocab_size = loop.trainer.vocab_size + 10  # as another model's server would report
    loop.sync_replicas()
    assert f"inference replica {replicas[0].address} serves a vocabulary of {loop.trainer.vocab_size + 10} " \
           f"tokens; the learner's model has {loop.trainer.vocab_size}" in loop.state.replica_errors[replicas[0].address]


def test_a_replica_sharing_the_policy_dir_gets_each_version_by_reference_the_other_is_streamed(model_dir, tmp_path):
    near = Replica("127.0.0.1:9200", model_dir, policy_dir=tmp_path / "policy")  # the learner's folder: one host
    far = Replica("127.0.0.1:9201", model_dir, policy_dir=tmp_path / "elsewhere")  # another host's folder
    try:
        loop = _loop(model_dir, [near, far], tmp_path / "policy")
        with torch.no_grad():
            next(loop.trainer.model.parameters()).add_(0.5)
        for v in (1, 2):
            loop.trainer.policy_version = v
            loop._push(v)
        assert (near.pushes, near.by_reference) == (2, 2)
        assert (far.pushes, far.by_reference, far.refused) == (2, 0, 1)  # asked by reference once, then streamed
        s = loop.state
        assert (s.pushes_by_reference, s.pushes_streamed, s.push_failures) == (2, 2, 0)
        for r in (near, far):
            assert (r.engine.policy_version, r.engine.lineage) == (2, loop.lineage)
        prompt, params = [[2, 5, 6]], SamplingParams(n=1, temperature=0.0, max_tokens=3)
        a, _ = near.engine.generate(prompt, params)
        b, _ = far.engine.generate(prompt, params)
        assert a[0].completions[0].token_ids == b[0].completions[0].token_ids
        assert a[0].completions[0].logprobs == pytest.approx(b[0].completions[0].logprobs, abs=1e-5)
        near.engine.policy_version = 0  # as a restarted replica: the sync pushes the stored version by reference
        near.engine.lineage = ""
        assert loop.sync_replicas() == [near.address] and near.by_reference == 3
    finally:
        near.close()
        far.close()


def test_a_replica_failing_to_read_the_stored_file_gets_that_version_streamed(model_dir, tmp_path, monkeypatch):
    """An internal error on the replica's side of an update by reference (here: its read of the stored file
    raises) does not cost the version: the learner streams it at once, and asks by reference again next time."""
    from temper.inference import servicer as servicer_module

    near = Replica("127.0.0.1:9300", model_dir, policy_dir=tmp_path / "policy")
    real_read, failures = servicer_module.policy_store.read_version, [1]

    def flaky_read(*args, **kwargs):
        if failures:
            failures.pop()
            raise RuntimeError("disk on fire")
        return real_read(*args, **kwargs)

    monkeypatch.setattr(servicer_module.policy_store, "read_version", flaky_read)
    try:
        loop = _loop(model_dir, [near], tmp_path / "policy")
        for v in (1, 2):
            loop.trainer.policy_version = v
            loop._push(v)
        assert (near.refused, near.pushes, near.by_reference) == (1, 2, 1)  # v1: refused, streamed; v2: by reference
        s = loop.state
        assert (s.pushes_by_reference, s.pushes_streamed, s.push_failures) == (1, 1, 0)
        assert near.engine.policy_version == 2 and near.address not in loop._stream_to
    finally:
        near.close()
