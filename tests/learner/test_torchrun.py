"""The learner started by torchrun, as on several hosts (deploy/k8s/overlays/ranks): ``torchrun --nproc-per-node 2
-m temper.learner <the launcher's flags>`` against a real replay and inference. The process of RANK 0 serves
gRPC and trains with the other as its follower (same checkpoint folder, shards written by both ranks), the
weights reach inference, SIGTERM to torchrun ends both ranks; a world the configuration cannot run stops
every rank naming the field; a checkpoint folder some rank cannot see stops every rank naming the hosts."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from temper.runtime.launcher import Launcher, _service_env, pid_alive
from temper.runtime.service import read_port_file
from tests.conftest import wait_until
from tests.learner.test_ranks import SERVICE

pytestmark = pytest.mark.slow

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                kids = [int(c) for c in (task / "children").read_text().split()]
                out += kids
                todo += kids
        except FileNotFoundError:
            continue
    return out


def _torchrun(launcher: Launcher, tmp_path: Path, state) -> tuple[subprocess.Popen, Path]:
    cfg = launcher.config()
    addresses = {n: [p.address] for n, p in state.services.items()}
    flags = launcher.service_flags("learner", cfg, launcher._model_dir(cfg), addresses, state.kafka_bootstrap)
    log = tmp_path / "torchrun.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([*TORCHRUN, "-m", "temper.learner", *flags], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env=_service_env(state.auth_token_file, "", 1))
    return proc, log


def test_the_learner_trains_over_two_ranks_started_by_torchrun(tmp_path):
    from temper.client.sdk import InferenceClient, LearnerClient, ReplayClient
    from tests.learner.test_service import make_groups

    config = tmp_path / "temper.toml"
    config.write_text(SERVICE.format(model_dir=tmp_path / "model", ranks=1))  # ranks: torchrun's
    launcher = Launcher(home=tmp_path / "home", config=config)
    state = launcher.up(["inference", "replay"])
    proc, log = _torchrun(launcher, tmp_path, state)
    ranks: list[int] = []
    try:
        port_file = launcher.home / "ports" / "learner.json"
        report = wait_until(lambda: proc.poll() is None and read_port_file(port_file), 180,
                            what=f"the learner's port (log: {log})")
        ranks = [p for p in _descendants(proc.pid) if b"temper.learner" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(ranks) == 2, ranks  # torchrun's two processes: the service and its follower
        addr = {n: p.address for n, p in state.services.items()}
        inference, replay = InferenceClient(addr["inference"]), ReplayClient(addr["replay"])
        learner = LearnerClient(report["address"])
        learner.wait_ready(180)
        replay.insert(make_groups(inference, 8, seed=1, job_id="torchrun"))  # 2 steps of 4 groups
        wait_until(lambda: learner.status().step >= 2, 180, what=f"2 steps over torchrun's 2 ranks (log: {log})")
        assert learner.status().policy_version == 2
        wait_until(lambda: inference.policy_version() == 2, 60, what="the weights at inference")
        # checkpoint_every = 1: both ranks wrote their shards of the parameters into the one folder
        step2 = launcher.home / "data" / "learner" / "checkpoints" / "step-00000002"
        shards = wait_until(lambda: sorted(p.name for p in step2.glob("shards/*.distcp")), 60,
                            what="the sharded checkpoint of step 2")
        assert len(shards) == 2, shards
        proc.send_signal(signal.SIGTERM)  # as Kubernetes stops the pod: torchrun passes it on, rank 0 says stop
        proc.wait(timeout=90)  # torchrun's own status on a signal is 1 (its SignalException)
        assert '"event": "stopped"' in log.read_text(), log.read_text()[-3000:]  # rank 0 stopped cleanly
        wait_until(lambda: not any(pid_alive(p) for p in ranks), 30, what="both ranks to exit")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        launcher.down()
    assert not [p for p in ranks if pid_alive(p)], "ranks left behind"


def test_a_world_the_configuration_cannot_run_stops_every_rank_naming_the_field(tmp_path):
    config = tmp_path / "temper.toml"
    config.write_text(SERVICE.format(model_dir=tmp_path / "model", ranks=3))  # torchrun starts 2
    launcher = Launcher(home=tmp_path / "home", config=config)
    state = launcher.up(["replay"])
    try:
        proc, log = _torchrun(launcher, tmp_path, state)
        assert proc.wait(timeout=180) != 0
        text = log.read_text()
        assert "ranks: 3, but torchrun started 2 ranks" in text
        assert "rank 1: ranks: 3" in text  # the follower says so too, and leaves at once
    finally:
        launcher.down()


def _check(rank: int, store: str, folder: str, out: str) -> None:
    from temper.learner import ranks

    import torch.distributed as dist

    ranks.init(rank, 2, Path(store))
    try:
        ranks.check_shared(Path(folder))
        Path(out).write_text("shared")
    except ValueError as e:
        Path(out).write_text(str(e))
    finally:  # as the learner does: a gloo group left to the interpreter's exit may abort it (SIGABRT)
        dist.destroy_process_group()


@pytest.mark.parametrize("same", [True, False])
def test_a_checkpoint_folder_some_rank_cannot_see_is_named_on_every_rank(tmp_path, same):
    # rank 1 looks in another folder, as a rank on another host whose checkpoint_dir is its own disk
    folders = [tmp_path / "ckpt", tmp_path / ("ckpt" if same else "elsewhere")]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_check, args=(r, str(tmp_path / "store"), str(folders[r]), str(tmp_path / f"{r}.out")))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    outs = [(tmp_path / f"{r}.out").read_text() for r in range(2)]
    if same:
        assert outs == ["shared", "shared"]
        assert not list(folders[0].iterdir())  # the marker is removed
    else:
        for text in outs:
            assert text.startswith("checkpoint_dir: ") and "(rank 1 on " in text and "rank 0 on " in text, text
