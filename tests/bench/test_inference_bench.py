"""Inference benchmark (`make bench`) on SmolLM2-135M-Instruct, all figures from one run.

1. Generated tokens/s through the gRPC service vs the same engine (vLLM) called in-process,
   the same workload: concurrent callers, each asking for a few chat prompts x n samples.
   Goal (issue 4): grpc / in-process >= 0.9.
2. vLLM vs HF engine tokens/s in-process, same workload and dtype.
3. (test_weight_update_bench) A full weight update over gRPC (every tensor, as the learner holds them: fp32) vs the floor
   of serialising the same tensors to safetensors bytes, reading them back and copying them
   into a model of the same shapes, in this process. Goal: grpc / floor <= 2. Both ways the learner
   pushes: every chunk streamed (a replica on another host), and by reference (one host: the version
   written to the shared policy_dir, as the learner stores every version anyway, then one UpdateWeights
   naming it; the write counts in the update's time).

The machine is shared: rounds alternate between the contenders and each reports its best
round; the CPU seconds per generated token (all processes involved) are printed too, being
less disturbed by other load than wall time.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from transformers import AutoModelForCausalLM

from temper.client.sdk import InferenceClient
from temper.inference import policy_store
from temper.inference.engine import SamplingParams, build_engine
from temper.inference.weights import chunks_from_tensors
from temper.v1 import inference_pb2
from temper.models.smollm2 import DEFAULT_DIR, ensure_smollm2
from tests.conftest import spawn_service

pytestmark = [pytest.mark.bench, pytest.mark.timeout(1800)]

MODEL_DIR = Path(__file__).resolve().parents[2] / DEFAULT_DIR
QUESTIONS = ["Name three colors.", "What is 12 times 7?", "Write a haiku about rain.", "Explain gravity briefly.",
             "List two prime numbers.", "What is the capital of France?", "Say hello in Spanish.",
             "Describe a cat in one sentence."]
CALLERS, PROMPTS_PER_CALL, N, MAX_TOKENS, ROUNDS = 4, 2, 4, 32, 3
ENGINE_FLAGS = dict(dtype="auto", max_model_len=1024, kv_cache_memory_bytes=256 << 20)


@pytest.fixture(scope="module", autouse=True)
def vllm_env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("vllm-cache")
    env = dict(VLLM_CACHE_ROOT=str(cache / "vllm"), TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
               VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _cpu_seconds(pid: int | None = None) -> float:
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run_callers(call) -> tuple[int, float]:
    """CALLERS threads, each one call; returns (generated tokens, wall seconds)."""
    counts = [0] * CALLERS
    errors = []

    def worker(k):
        try:
            counts[k] = call(k)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(CALLERS)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    assert not errors, errors
    return sum(counts), wall


def _measure(name: str, call, pids: tuple[int | None, ...], best: dict) -> None:
    cpu0 = sum(_cpu_seconds(p) for p in pids)
    tokens, wall = _run_callers(call)
    cpu = sum(_cpu_seconds(p) for p in pids) - cpu0
    prev = best.get(name)
    if prev is None or tokens / wall > prev["tok_s"]:
        best[name] = {"tok_s": tokens / wall, "tokens": tokens, "wall": wall, "cpu_per_tok": cpu / tokens}


def test_inference_bench(tmp_path):
    model_dir = ensure_smollm2(MODEL_DIR)
    vllm = build_engine("vllm", model_dir, **ENGINE_FLAGS)
    hf = build_engine("hf", model_dir, dtype="auto")
    prompts = [vllm.encode(q, apply_chat_template=True) for q in QUESTIONS]
    params = [SamplingParams(n=N, temperature=1.0, max_tokens=MAX_TOKENS, seed=k) for k in range(CALLERS)]

    def in_process(engine):
        def call(k):
            results, _ = engine.generate(prompts[k * PROMPTS_PER_CALL:(k + 1) * PROMPTS_PER_CALL], params[k])
            return sum(len(c.token_ids) for r in results for c in r.completions)
        return call

    best: dict = {}
    svc = spawn_service("inference", tmp_path, "--model-dir", str(model_dir), "--engine", "vllm", "--dtype", "auto",
                        "--max-model-len", "1024", "--kv-cache-memory-bytes", str(256 << 20), timeout=240)
    proc = svc.proc
    try:
        client = svc.client(InferenceClient, timeout=600)

        def over_grpc(k):
            resp = client.generate(prompts[k * PROMPTS_PER_CALL:(k + 1) * PROMPTS_PER_CALL], n=N, temperature=1.0,
                                   max_tokens=MAX_TOKENS, seed=k)
            return sum(len(c.token_ids) for r in resp.results for c in r.completions)

        for contender in (in_process(vllm), over_grpc, in_process(hf)):  # warm-up: kernels, caches
            _run_callers(contender)
        for _ in range(ROUNDS):
            _measure("vllm in-process", in_process(vllm), (None,), best)
            _measure("vllm over gRPC", over_grpc, (None, proc.pid), best)
            _measure("hf in-process", in_process(hf), (None,), best)

        client.close()
    finally:
        svc.stop()
    vllm.close()
    hf.close()

    grpc_ratio = best["vllm over gRPC"]["tok_s"] / best["vllm in-process"]["tok_s"]
    engine_ratio = best["vllm in-process"]["tok_s"] / best["hf in-process"]["tok_s"]
    print(f"\n-- inference bench: SmolLM2-135M-Instruct (bf16), {CALLERS} concurrent callers x {PROMPTS_PER_CALL} "
          f"chat prompts x n={N}, <= {MAX_TOKENS} tokens, best of {ROUNDS} rounds")
    for name, b in best.items():
        print(f"{name:>18}: {b['tok_s']:8.1f} tok/s  ({b['tokens']} tokens in {b['wall']:.2f}s, "
              f"{1000 * b['cpu_per_tok']:.2f} CPU ms/token)")
    cpu_ratio = best["vllm in-process"]["cpu_per_tok"] / best["vllm over gRPC"]["cpu_per_tok"]
    print(f"gRPC / in-process tokens/s: {grpc_ratio:.2f}  (goal >= 0.9); by CPU time per token "
          f"(server + client processes): {cpu_ratio:.2f}")
    print(f"vLLM / HF tokens/s:         {engine_ratio:.2f}")
    assert best["vllm over gRPC"]["tokens"] > 0 and best["hf in-process"]["tokens"] > 0


SINK = """
import grpc
from concurrent import futures
server = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.max_receive_message_length", 64 << 20)])
server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Sink", {"Count":
    grpc.stream_unary_rpc_method_handler(lambda it, ctx: str(sum(len(b) for b in it)).encode(),
                                         request_deserializer=bytes, response_serializer=bytes)})])
print(server.add_insecure_port("127.0.0.1:0"), flush=True)
server.start()
server.wait_for_termination()
"""


def test_weight_update_bench(tmp_path):
    """A full weight update over gRPC into a vLLM replica (every tensor, fp32 as the learner holds them) vs the
    floor of serialising the same tensors to safetensors, reading them back and copying them into a model of the
    same shapes, in this process; best of ``ROUNDS`` each, alternating."""
    model_dir = ensure_smollm2(MODEL_DIR)
    # the folder learner and inference share on one host (TEMPER_BENCH_POLICY_DIR: e.g. a tmpfs one)
    policy_dir = Path(os.environ.get("TEMPER_BENCH_POLICY_DIR") or tmp_path) / "policy"
    svc = spawn_service("inference", tmp_path, "--model-dir", str(model_dir), "--engine", "vllm", "--dtype", "auto",
                        "--max-model-len", "1024", "--kv-cache-memory-bytes", str(256 << 20), "--policy-dir",
                        str(policy_dir), timeout=240)
    try:
        client = svc.client(InferenceClient, timeout=600)
        learner = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tensors = {n: p.detach() + 0.0 for n, p in learner.named_parameters()}
        target = {n: torch.empty_like(t) for n, t in tensors.items()}  # where the floor copies to
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        update, floor, by_ref, by_ref_write = float("inf"), float("inf"), float("inf"), 0.0
        update_cpu, floor_cpu, apply_seconds, by_ref_cpu, by_ref_apply = 0.0, 0.0, 0.0, 0.0, 0.0
        version = 0
        writer = policy_store.Writer(policy_dir)  # as the learner stores: the next file allocated while it trains
        for _ in range(ROUNDS):
            cpu0 = _cpu_seconds()
            t0 = time.perf_counter()
            for name, t in tensors.items():
                target[name].copy_(load_safetensors(save_safetensors({name: t}))[name])
            if time.perf_counter() - t0 < floor:
                floor, floor_cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
            cpu0 = _cpu_seconds() + _cpu_seconds(svc.proc.pid)
            t0 = time.perf_counter()
            version += 1
            resp = client.update_weights(chunks_from_tensors(tensors, new_version=version, encoded=True))
            if time.perf_counter() - t0 < update:
                update = time.perf_counter() - t0
                update_cpu = _cpu_seconds() + _cpu_seconds(svc.proc.pid) - cpu0
                apply_seconds = resp.apply_seconds
            assert resp.policy_version == version
            # by reference: what the learner's push costs when the replica shares its policy_dir
            cpu0 = _cpu_seconds() + _cpu_seconds(svc.proc.pid)
            version += 1
            t0 = time.perf_counter()
            writer.write(tensors, version, "", stored_id=f"bench-{version}")  # waits for the spare if not ready
            written = time.perf_counter() - t0
            resp = client.update_weights([inference_pb2.UpdateWeightsRequest(stored_id=f"bench-{version}",
                                                                             new_version=version)])
            if time.perf_counter() - t0 < by_ref:
                by_ref, by_ref_write = time.perf_counter() - t0, written
                by_ref_cpu = _cpu_seconds() + _cpu_seconds(svc.proc.pid) - cpu0
                by_ref_apply = resp.apply_seconds
            assert resp.policy_version == version
        # where the time goes: building every chunk alone, in this process; the same chunks' bytes streamed
        # over gRPC to a server process that only counts them
        build, stream = float("inf"), float("inf")
        wire = list(chunks_from_tensors(tensors, new_version=1, encoded=True))
        sink = subprocess.Popen([sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True)
        try:
            port = int(sink.stdout.readline())
            with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
                count = ch.stream_unary("/bench.Sink/Count", request_serializer=bytes, response_deserializer=bytes)
                for _ in range(ROUNDS):
                    t0 = time.perf_counter()
                    for _chunk in chunks_from_tensors(tensors, new_version=1, encoded=True):
                        pass
                    build = min(build, time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    assert int(count(iter(wire), timeout=120)) == sum(len(b) for b in wire)
                    stream = min(stream, time.perf_counter() - t0)
        finally:
            sink.kill()
            sink.wait()
        writer.close()
        client.close()
    finally:
        svc.stop()
    print(f"\nweight update, {len(tensors)} tensors, {size / 2**20:.0f} MiB fp32, best of {ROUNDS}: over gRPC "
          f"{update:.2f}s ({update_cpu:.2f} CPU s; engine apply {apply_seconds:.2f}s) vs floor {floor:.2f}s "
          f"({floor_cpu:.2f} CPU s): {update / floor:.2f}x  (goal <= 2). Where the time goes: building the chunks "
          f"alone {build:.2f}s; their bytes streamed over gRPC to a server that only counts them {stream:.2f}s "
          f"({stream / floor:.2f}x the floor); the engine's apply {apply_seconds / floor:.2f}x the floor. By reference "
          f"(one host: written to the shared policy_dir, then one UpdateWeights naming it): {by_ref:.2f}s "
          f"({by_ref_cpu:.2f} CPU s; the write {by_ref_write:.2f}s, the engine's apply {by_ref_apply:.2f}s): "
          f"{by_ref / floor:.2f}x  (goal <= 2)")
    assert update < float("inf") and by_ref < float("inf") and floor > 0
