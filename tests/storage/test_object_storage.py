"""Object storage against a real S3 server (SeaweedFS): folders round-trip, the learner resumes from
checkpoints in the store, replay restores snapshots from it, and a store that cannot be used stops a
service at start with the URL and the reason (never a fall back to local disk)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from temper.learner import checkpoint
from temper.learner.loop import UPLOAD_FAILURES, LearnerLoop
from temper.learner.trainer import Trainer, TrainerConfig
from temper.models.tiny import build_tiny_model
from temper.replay.store import ReplayStore
from temper.runtime.storage import Mirror, ObjectStore, StorageError, main as storage_main
from temper.v1 import common_pb2
from tests.learner.test_trainer import synthetic_batch
from tests.builders import scored_group


def closed_port() -> int:
    """A port nothing listens on (bound then released by this process, never handed to a child)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def files(root) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.mark.parametrize("backend", ["s3", "local"])
def test_folders_round_trip_with_a_latest_pointer_and_pruning(backend, s3_env, tmp_path):
    url = f"s3://temper/roundtrip-{os.getpid()}" if backend == "s3" else str(tmp_path / "store")
    mirror = Mirror(ObjectStore(url))
    src = tmp_path / "src"
    for i in range(4):
        d = src / f"step-{i:08d}"
        (d / "sub").mkdir(parents=True)
        (d / "model.bin").write_bytes(os.urandom(300_000 + i))
        (d / "sub" / "meta.json").write_text(f'{{"step": {i}}}')
        assert mirror.push(d) == f"{url}/step-{i:08d}"
    assert mirror.latest() == "step-00000003"
    assert mirror.prune(2, prefix="step-") == ["step-00000000", "step-00000001"]
    assert mirror.store.names() == ["latest", "step-00000002", "step-00000003"]
    got = mirror.pull("step-00000003", tmp_path / "dst")
    assert files(got) == files(src / "step-00000003")
    assert not list((tmp_path / "dst").glob(".*"))  # no download leftovers
    assert mirror.store.read_bytes("nothing-here") is None
    with pytest.raises(StorageError, match="no folder 'step-00000000'"):
        mirror.pull("step-00000000", tmp_path / "dst")


def test_the_learner_resumes_from_the_object_store_on_an_empty_disk(s3_env, model_dir, tmp_path):
    url = f"s3://temper/learner-{os.getpid()}"
    cfg = TrainerConfig()
    a = Trainer(model_dir, cfg)
    loop_a = LearnerLoop(a, None, [], None, 8, checkpoint_dir=tmp_path / "pod-a", keep_checkpoints=2,
                         mirror=Mirror(ObjectStore(url)))
    for i in range(3):
        a.step(synthetic_batch(i))
        loop_a.checkpoint()
    assert Mirror(ObjectStore(url)).store.names() == ["latest", "step-00000002", "step-00000003"]
    expected = a.step(synthetic_batch(10))

    # a new pod: empty checkpoint dir, another RNG state; only the object store has the checkpoints
    torch.manual_seed(999)
    b = Trainer(model_dir, cfg.model_copy(update={"seed": 3}))
    loop_b = LearnerLoop(b, None, [], None, 8, checkpoint_dir=tmp_path / "pod-b", mirror=Mirror(ObjectStore(url)))
    assert loop_b.resume_from_checkpoint()
    assert (b.step_count, loop_b.state.resumed) == (3, True)
    assert checkpoint.latest(tmp_path / "pod-b").name == "step-00000003"
    got = b.step(synthetic_batch(10))
    assert got["loss"] == expected["loss"]
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))

    # a newer local checkpoint than the store's is kept (the store is not allowed to roll it back)
    c = Trainer(model_dir, cfg)
    checkpoint.mark_latest(tmp_path / "pod-b", checkpoint.save(b, tmp_path / "pod-b" / "step-00000004"))
    loop_c = LearnerLoop(c, None, [], None, 8, checkpoint_dir=tmp_path / "pod-b", mirror=Mirror(ObjectStore(url)))
    assert loop_c.resume_from_checkpoint() and c.step_count == 4


def test_replay_restores_a_snapshot_from_the_object_store(s3_env, tmp_path):
    url = f"s3://temper/replay-{os.getpid()}"
    a = ReplayStore(tmp_path / "a" / "replay.sqlite", ["default"], tmp_path / "a" / "ckpt", mirror=Mirror(ObjectStore(url)))
    a.insert("default", [scored_group(f"g{i}", seed=i) for i in range(5)])
    ckpt_id, size, sizes = a.checkpoint()
    a.close()
    assert sizes == {"default": 5} and size > 0
    assert ObjectStore(url).exists(f"{ckpt_id}/replay.sqlite")

    b = ReplayStore(tmp_path / "b" / "replay.sqlite", ["default"], tmp_path / "b" / "ckpt", mirror=Mirror(ObjectStore(url)))
    assert b.stats("default").size == 0
    assert b.restore(ckpt_id) == {"default": 5}
    sample = b.sample("default", 5, timeout=1.0, max_batch=10)
    assert sorted(d.group_id for d in sample.draws) == [f"g{i}" for i in range(5)]
    b.close()


# -- a store that cannot be used ---------------------------------------------------------------
def test_an_unreachable_store_fails_fast_naming_url_and_reason(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    t0 = time.monotonic()
    with pytest.raises(StorageError, match=r"object store s3://temper/x: not writable \(.*(Connect|connect)"):
        ObjectStore("s3://temper/x")
    assert time.monotonic() - t0 < 30


def test_wrong_credentials_are_refused(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(StorageError, match=r"object store s3://temper/x: not writable \(PermissionError: .*signature"):
        ObjectStore("s3://temper/x")


@pytest.mark.parametrize("url, reason", [("gs://b/p", "unsupported scheme 'gs'"), ("s3://", "no bucket named"),
                                         ("", "empty URL")])
def test_malformed_urls_are_refused(url, reason):
    with pytest.raises(StorageError, match=reason):
        ObjectStore(url)


@pytest.mark.parametrize("service, flag", [("replay", "--snapshot-url"), ("learner", "--checkpoint-url")])
def test_a_service_with_an_unusable_store_does_not_start(service, flag, s3_env, tmp_path):
    """The check comes first: the learner's model dir does not even exist, and the store is named."""
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{closed_port()}"}
    out = subprocess.run([sys.executable, "-m", f"temper.{service}", flag, "s3://temper/ckpt", "--data-dir",
                          str(tmp_path / "data"), "--model-dir", str(tmp_path / "no-model"), "--metrics-port", "-1"]
                         if service == "learner" else
                         [sys.executable, "-m", f"temper.{service}", flag, "s3://temper/ckpt", "--data-dir",
                          str(tmp_path / "data"), "--ingest-tables", "[]", "--metrics-port", "-1"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0
    field = flag.removeprefix("--").replace("-", "_")
    assert f"temper-{service}: {field}: object store s3://temper/ckpt: not writable" in out.stderr, out.stderr
    assert not (tmp_path / "data" / "replay.sqlite").exists()  # nothing was written locally instead


def test_fetch_command_downloads_a_model_folder_once(s3_env, model_dir, tmp_path, capsys):
    store = ObjectStore(f"s3://temper/models-{os.getpid()}")
    store.put_dir(model_dir, "tiny")
    target = tmp_path / "models" / "policy"
    assert storage_main(["fetch", f"{store.url}/tiny", str(target)]) == 0
    assert files(target) == files(model_dir)
    assert storage_main(["fetch", f"{store.url}/tiny", str(target)]) == 0  # a restarted pod keeps its copy
    assert "kept" in capsys.readouterr().out
    assert storage_main(["fetch", f"{store.url}/missing", str(tmp_path / "other")]) == 1
    assert "no folder 'missing'" in capsys.readouterr().err


def _groups(n: int) -> list[common_pb2.RolloutGroup]:
    """Scored groups over the tiny model's vocabulary, each with a learning signal."""
    return [common_pb2.RolloutGroup(group_id=f"g{i}", job_id="j", task=common_pb2.Task(domain="toy.copy"), trajectories=[
        common_pb2.Trajectory(trajectory_id=f"g{i}/{k}", group_id=f"g{i}", prompt_token_ids=[2, 5 + i, 7],
                              completion_token_ids=[6 + k, 9], completion_logprobs=[-1.0, -2.0],
                              reward=common_pb2.Reward(total=float(k % 2), status=common_pb2.REWARD_STATUS_OK))
        for k in range(4)]) for i in range(n)]


def test_a_periodic_checkpoint_that_cannot_be_uploaded_is_counted_and_training_goes_on(s3_env, model_dir, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")  # the store went away mid-run
    mirror = Mirror(ObjectStore("s3://temper/gone", check=False))
    loop = LearnerLoop(Trainer(model_dir, TrainerConfig()), None, [], None, 2, checkpoint_dir=tmp_path / "ckpt",
                       checkpoint_every=1, mirror=mirror)
    before = UPLOAD_FAILURES._value.get()
    assert loop.train_on(_groups(2)) is not None and loop.state.step == 1
    assert UPLOAD_FAILURES._value.get() == before + 1
    assert checkpoint.latest(tmp_path / "ckpt").name == "step-00000001"  # on local disk all the same
    assert loop.train_on(_groups(2)) is not None and loop.state.step == 2
    assert UPLOAD_FAILURES._value.get() == before + 2
    with pytest.raises(StorageError, match="object store s3://temper/gone: upload manual/"):
        loop.checkpoint("manual")  # asked for: the caller hears of it (a Checkpoint RPC answers UNAVAILABLE)
