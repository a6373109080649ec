"""The inference service over real gRPC, with the vLLM engine, as its own process on 127.0.0.1."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from temper.client.sdk import InferenceClient
from temper.inference import policy_store
from temper.inference.weights import chunks_from_tensors
from temper.runtime.rpc import check_health
from temper.v1 import inference_pb2
from tests.conftest import spawn_service
from tests.inference.teacher import max_logprob_error, perturbed, set_weights

IA = grpc.StatusCode.INVALID_ARGUMENT
FP = grpc.StatusCode.FAILED_PRECONDITION


@pytest.fixture(scope="module")
def service(tiny_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("inference")
    svc = spawn_service("inference", home, "--model-dir", str(tiny_dir), "--engine", "vllm", "--dtype", "float32",
                        "--kv-cache-memory-bytes", str(32 << 20), "--policy-dir", str(home / "policy"), timeout=240)
    try:
        client = svc.client(InferenceClient, timeout=120)
        client.policy_dir = home / "policy"  # what a learner on this host shares with it
        yield client, svc.proc
        client.close()
    finally:
        svc.stop()
    assert svc.proc.poll() is not None, "the server outlived its test"


def expect(code, field, fn, *args, **kwargs):
    with pytest.raises(grpc.RpcError) as e:
        fn(*args, **kwargs)
    assert e.value.code() == code, e.value.details()
    assert field in e.value.details(), e.value.details()


def test_generate_and_update_over_grpc(service, teacher):
    client, _ = service
    start = client.stub.GetPolicyVersion(inference_pb2.GetPolicyVersionRequest())
    assert start.engine == "vllm"
    ids = [5, 6, 7]
    resp = client.generate(["copy 1 2 3", ids], n=3, temperature=0.9, max_tokens=6, seed=0)
    assert resp.policy_version == start.policy_version
    assert list(resp.results[1].prompt_token_ids) == ids
    for r in resp.results:
        assert len(r.completions) == 3
        for c in r.completions:
            assert 0 < len(c.token_ids) == len(c.logprobs) <= 6 and c.finish_reason in ("stop", "length")
    assert max_logprob_error(teacher, resp.results, 0.9) < 1e-4

    checkpoint = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    new = perturbed(teacher, seed=21)
    update = client.update_weights(chunks_from_tensors(new, new_version=start.policy_version + 5, chunk_bytes=1000))
    assert update.policy_version == start.policy_version + 5 and update.tensors == len(new)
    assert client.policy_version() == start.policy_version + 5
    resp = client.generate(["copy 1 2 3", ids], n=3, temperature=0.9, max_tokens=6, seed=0)
    assert resp.policy_version == start.policy_version + 5
    try:
        set_weights(teacher, new)
        assert max_logprob_error(teacher, resp.results, 0.9) < 1e-4
    finally:
        set_weights(teacher, checkpoint)
    # back, for the next tests
    assert client.update_weights(chunks_from_tensors(checkpoint)).policy_version == start.policy_version + 6


def test_concurrent_clients(service):
    client, _ = service
    out, errors = [], []

    def call(k):
        try:
            out.append(client.generate([[5 + k % 10, 6, 7]], n=2, temperature=1.0, max_tokens=12))
        except grpc.RpcError as e:
            errors.append(e)

    threads = [threading.Thread(target=call, args=(k,)) for k in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(out) == 12
    assert len({r.policy_version for r in out}) == 1


def test_bad_requests_name_the_field_and_keep_the_old_version(service, teacher):
    client, proc = service
    version = client.policy_version()
    expect(IA, "prompts", client.generate, [])
    expect(IA, "sampling.n", client.generate, ["copy 1"], n=0)
    expect(IA, "sampling.max_tokens", client.generate, ["copy 1"], max_tokens=1_000_000)
    expect(IA, "prompts[0]", client.generate, [[5] * 200], max_tokens=4)
    expect(IA, "prompts[1].text", client.generate, ["copy 1", ""])
    expect(IA, "prompts[0].apply_chat_template", client.generate, ["copy 1"], apply_chat_template=True)
    expect(IA, "prompts[0].token_ids", client.generate, [[10_000]])
    # an unknown sampling field (number 99) is refused, not ignored
    req = inference_pb2.GenerateRequest(prompts=[inference_pb2.Prompt(text="copy 1")],
                                        sampling=inference_pb2.SamplingParams(n=1, max_tokens=1))
    raw = req.SerializeToString() + bytes([0x12, 0x03, 0x98, 0x06, 0x01])  # sampling += {99: 1}
    rpc = client._channel.unary_unary("/temper.v1.InferenceService/Generate", request_serializer=lambda b: b,
                                      response_deserializer=inference_pb2.GenerateResponse.FromString)
    expect(IA, "request.sampling", rpc, raw, timeout=30)

    good = {n: p.detach() for n, p in teacher.named_parameters()}
    name = next(iter(good))
    bad_sum = list(chunks_from_tensors(good))
    bad_sum[0].sha256 = "0" * 64
    expect(IA, f"tensor {name}", client.stub.UpdateWeights, iter(bad_sum), timeout=60)
    push = lambda t, **kw: client.update_weights(chunks_from_tensors(t, **kw))  # noqa: E731
    expect(IA, f"tensor {name}", push, {k: v for k, v in good.items() if k != name})
    expect(IA, f"tensor {name}", push, {**good, name: torch.zeros(2, 2)})
    expect(IA, "tensor extra.weight", push, {**good, "extra.weight": torch.zeros(2)})
    expect(IA, f"tensor {name}", push, {**good, name: torch.full_like(good[name], float("inf"))})
    partial = list(chunks_from_tensors(good, chunk_bytes=1000))
    expect(IA, "tensor", client.stub.UpdateWeights, iter(partial[:-1]), timeout=60)  # stream cut mid-tensor
    expect(IA, "new_version", push, good, new_version=version)
    assert client.policy_version() == version
    assert check_health(client.address) == "SERVING" and proc.poll() is None
    resp = client.generate(["copy 1 2 3"], n=2, temperature=1.0, max_tokens=4)
    assert resp.policy_version == version
    assert max_logprob_error(teacher, resp.results, 1.0) < 1e-4  # still the checkpoint's weights


def test_an_update_by_reference_installs_the_version_stored_in_the_shared_policy_dir(service, teacher):
    """The learner's path on one host: the version written to policy_dir under an id, then installed by a one-message
    UpdateWeights naming it (no tensor bytes over gRPC); the served policy is exactly the stored one. A reference
    the server cannot honour is FAILED_PRECONDITION naming stored_id (the learner then streams), malformed ones
    INVALID_ARGUMENT naming the field; none changes the serving version."""
    client, proc = service
    info = client.info()
    assert info.reads_stored_updates
    version = info.policy_version
    checkpoint = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    new = perturbed(teacher, seed=33)
    policy_store.write(client.policy_dir, new, version + 1, "", stored_id="id-1")
    ref = lambda **kw: client.update_weights([inference_pb2.UpdateWeightsRequest(**kw)])  # noqa: E731
    for field, code, kw in [
            ("stored_id", FP, dict(stored_id="id-2", new_version=version + 1)),  # another writer's file
            ("stored_id", FP, dict(stored_id="id-1", new_version=version + 2)),  # not stored
            ("stored_id", FP, dict(stored_id="id-1", new_version=version + 1, lineage="run-x")),  # another lineage
            ("new_version", IA, dict(stored_id="id-1")),
            ("stored_id", IA, dict(stored_id="id-1", new_version=version + 1, tensor_name="x", data=b"12"))]:
        expect(code, field, ref, **kw)
    two = [inference_pb2.UpdateWeightsRequest(stored_id="id-1", new_version=version + 1)] * 2
    expect(IA, "chunks[1]", client.update_weights, two)
    late = [*chunks_from_tensors(checkpoint), inference_pb2.UpdateWeightsRequest(stored_id="id-1")]
    expect(IA, f"chunks[{len(late) - 1}].stored_id", client.update_weights, late)
    assert client.policy_version() == version and proc.poll() is None

    update = ref(stored_id="id-1", new_version=version + 1)
    assert update.policy_version == version + 1 and update.tensors == len(new)
    assert update.bytes == policy_store.version_file(client.policy_dir, version + 1).stat().st_size
    resp = client.generate(["copy 1 2 3"], n=3, temperature=0.9, max_tokens=6, seed=0)
    assert resp.policy_version == version + 1
    try:
        set_weights(teacher, new)
        assert max_logprob_error(teacher, resp.results, 0.9) < 1e-4
    finally:
        set_weights(teacher, checkpoint)
    assert client.update_weights(chunks_from_tensors(checkpoint)).policy_version == version + 2  # back
