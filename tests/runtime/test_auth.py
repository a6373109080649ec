"""[auth] mode = "token" over real gRPC on loopback: refused without the token, never leaked."""

import json
import os
import stat
import subprocess
import sys

import grpc
import pytest

from temper.client.sdk import ReplayClient, SandboxClient
from temper.client.transport import AUTH_TOKEN_FILE_ENV, BearerToken
from temper.runtime.auth import AuthConfig, TokenAuthInterceptor
from temper.runtime.launcher import Launcher
from temper.runtime.rpc import check_health
from temper.v1 import replay_pb2, replay_pb2_grpc

TEMPER = [sys.executable, "-m", "temper.cli.main"]


def _config(tmp_path, extra: str = "") -> str:
    path = tmp_path / "job.toml"
    path.write_text(f'[auth]\nmode = "token"\n{extra}')
    return str(path)


def test_a_bad_auth_table_names_the_key():
    with pytest.raises(ValueError, match=r"auth\.mode"):
        AuthConfig.from_config({"auth": {"mode": "password"}}, "job.toml")
    assert AuthConfig.from_config({}, "job.toml").mode == "none"


def test_the_token_is_never_in_a_repr():
    assert "s3cret" not in repr(BearerToken("s3cret")) + repr(TokenAuthInterceptor("s3cret"))


def test_a_sandbox_bind_that_holds_the_token_file_is_named(tmp_path, monkeypatch):
    from temper.runtime.auth import binds_exposing_secrets, write_token

    token_file = write_token(tmp_path / "home")
    monkeypatch.setenv(AUTH_TOKEN_FILE_ENV, str(token_file))
    assert binds_exposing_secrets(["/usr", str(tmp_path)]) == [str(tmp_path)]
    assert binds_exposing_secrets(["/usr", str(tmp_path / "other")]) == []
    monkeypatch.delenv(AUTH_TOKEN_FILE_ENV)
    assert binds_exposing_secrets([str(tmp_path)]) == []


@pytest.mark.slow
def test_replay_refuses_calls_without_or_with_a_wrong_token(tmp_path):
    home = tmp_path / "home"
    launcher = Launcher(home=home, config=_config(tmp_path))
    state = launcher.up(["replay"])
    try:
        address = state.services["replay"].address
        token_file = home / "auth" / "token"
        token = token_file.read_text()
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert stat.S_IMODE((home / "auth").stat().st_mode) == 0o700
        assert state.auth_token_file == str(token_file)

        with grpc.insecure_channel(address) as ch:  # a caller that knows nothing of the token
            stub = replay_pb2_grpc.ReplayServiceStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                stub.Stats(replay_pb2.StatsRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert token not in e.value.details()
        with ReplayClient(address, token="not-the-token") as wrong:
            with pytest.raises(grpc.RpcError) as e:
                wrong.stats()
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.RpcError) as e:  # a client-streaming method is refused the same way
                wrong.insert([])
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with ReplayClient(address, token=token) as right:
            assert right.stats().inserts == 0
        with ReplayClient(address) as from_env:  # up set $TEMPER_AUTH_TOKEN_FILE for this process's SDK calls
            assert os.environ[AUTH_TOKEN_FILE_ENV] == str(token_file)
            assert from_env.stats().inserts == 0
        assert check_health(address) == "SERVING"  # health checks stay open

        # the token is nowhere in plain sight: not on a command line, in the state file or a log
        pid = state.services["replay"].pid
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert token.encode() not in f.read()
        for path in [home / "state.json", *(home / "logs").iterdir()]:
            assert token not in path.read_text(errors="replace"), path
    finally:
        launcher.down()
    assert AUTH_TOKEN_FILE_ENV not in os.environ  # down put this process's environment back


@pytest.mark.slow
def test_sandboxed_programs_see_neither_the_token_nor_its_file(tmp_path):
    home = tmp_path / "home"
    launcher = Launcher(home=home, config=_config(tmp_path, "[sandbox]\n"))
    state = launcher.up(["sandbox"])
    try:
        token_file = home / "auth" / "token"
        probe = tmp_path / "probe.py"
        probe.write_text("import os\n"
                         "print(sorted(os.environ))\n"
                         "print(any('TEMPER' in k for k in os.environ))\n"
                         f"print(os.path.exists({str(token_file)!r}))\n")
        # through the CLI of another process, without the variable: it finds the token through --home
        run = subprocess.run([*TEMPER, "--home", str(home), "sandbox", "exec", str(probe)], capture_output=True,
                             text=True, timeout=300, env={k: v for k, v in os.environ.items() if k != AUTH_TOKEN_FILE_ENV})
        assert run.returncode == 0, run.stdout + run.stderr
        verdict = json.loads(run.stdout)
        assert verdict["via"].startswith("service"), verdict  # the running (authenticated) sandbox, not a new one
        assert verdict["stdout"].splitlines()[1:] == ["False", "False"], verdict
        assert token_file.read_text() not in verdict["stdout"]
        with grpc.insecure_channel(state.services["sandbox"].address) as ch:  # and the sandbox itself needs it
            from temper.v1 import sandbox_pb2_grpc

            with pytest.raises(grpc.RpcError) as e:
                sandbox_pb2_grpc.SandboxServiceStub(ch).Execute(SandboxClient.request("print(1)"), timeout=30)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        launcher.down()
