"""``temper reward load``: load a reward model folder into the running reward service (LoadModel), no restart.

  temper reward load --prm runs/grown/prm      # the process reward model (`temper prm grow` writes one)
  temper reward load --rm my-rm/               # the outcome reward model

The service of ``--home``'s stack (or ``--address``) loads the folder from its own file system, then
swaps it in: score calls switch to it once it has loaded, and if it does not load, the model it had
keeps serving. A domain scores with it when its ``[reward.domains.NAME].weights`` name ``prm`` / ``rm``.
"""

from __future__ import annotations

import json
from pathlib import Path


def reward_address(args, field: str = "--address") -> str:
    """--address, else the reward service of ``--home``'s stack (which must be SERVING); ``field``: the option
    a refusal names."""
    from temper.cli.main import _launcher
    from temper.runtime.rpc import check_health

    if getattr(args, "address", ""):
        return args.address
    state = _launcher(args).load()
    proc = state.services.get("reward") if state is not None else None
    if proc is None or check_health(proc.address) != "SERVING":
        raise ValueError(f"{field}: no reward service is SERVING in {args.home} (start the stack with `temper up`, "
                         "or give --address HOST:PORT)")
    return proc.address


def load_model(address: str, model_dir: str | Path, slot: str) -> dict:
    """LoadModel on the reward service at ``address``; what it loaded, as a JSON-ready dict."""
    import grpc

    from temper.client.sdk import RewardClient

    try:
        with RewardClient(address) as reward:
            r = reward.load_model(str(Path(model_dir).resolve()), slot=slot)
    except grpc.RpcError as e:
        if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
            raise ValueError(f"reward service refused the {slot}: {e.details()}") from None
        raise RuntimeError(f"reward service at {address}: {e.code().name}: {e.details()}") from None
    return {"slot": slot, "model_dir": r.model_dir, "version": r.version, "replaced": r.replaced_dir or None,
            "architecture": r.architecture, "step_tag": r.step_tag or None, "step_delimiter": r.step_delimiter,
            "address": address}


def cmd_reward_load(args) -> int:
    slot, folder = ("prm", args.prm) if args.prm else ("rm", args.rm)
    print(json.dumps(load_model(reward_address(args), folder, slot)))
    return 0


def add_commands(sub, command, common) -> None:
    rw = sub.add_parser("reward", help="the running reward service", parents=[common])
    rwsub = rw.add_subparsers(dest="reward_command", required=True)
    lo = command("load", cmd_reward_load, "load a reward model folder into the running reward service (no restart; "
                 "the old model serves until the new one has loaded)", into=rwsub)
    which = lo.add_mutually_exclusive_group(required=True)
    which.add_argument("--prm", default="", help="a process reward model folder (*ForTokenClassification)")
    which.add_argument("--rm", default="", help="an outcome reward model folder")
    lo.add_argument("--address", default="", help="the reward service's HOST:PORT (default: the stack of --home)")
