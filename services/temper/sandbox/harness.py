"""Python runner and assertion-test harness: runs inside the sandbox, as the program's own uid.

    python3 /grader/harness.py main.py      fd 3: control; fd 4: report (the agent reads it)
    python3 /grader/harness.py --fork-server    fd 3: the agent's socket (batch mode, see below)

The control pipe starts with the mode: ``run `` (run main.py exactly as ``python3 main.py``
would: ``__main__``, ``sys.argv``, ``sys.path[0]``, exit status) or ``test`` followed by a 32-byte
nonce and the test script. A pooled sandbox starts this interpreter ahead of time, blocked on
fd 3 before any request exists, so a run skips the interpreter's start-up.

In test mode it runs the program as ``__main__`` and then the test script in the same namespace
(the usual "program + tests" semantics of Python coding benchmarks). The run passes only if the
process exits 0 AND fd 4 carries exactly the nonce. The nonce is written by an audit hook, never
by code the program can reach, and only when the harness itself reaches its last line:
- the nonce lives only in the hook's closure (read into a bytearray, no other copy): the hook is
  reachable from Python only through ``gc`` (audited), and the process memory only through ctypes
  or ``/proc/*/mem`` (audited) or ptrace (blocked: the process is made non-dumpable). Any of
  those events, or ``sys.settrace``/``setprofile`` (which could jump the harness's frame), or
  swapping a function's ``__code__``, wipes the nonce: the run can then no longer pass;
- the hook writes the nonce only for the ``FINISH`` event raised on the main thread by the
  harness's own ``main`` frame sitting directly on the module frame, once. Program code always
  runs above that frame (or on another thread), so it cannot raise an accepted FINISH: exiting
  early (``sys.exit(0)``, ``os._exit(0)``, signals), printing or writing fake markers to any fd,
  and redefining checkers all end without the nonce;
- ``assert a == b`` in the test script is rewritten to call a probe (held as a code constant,
  so the program cannot rebind it) that fails values claiming equality with an object they have
  never seen (the "always equal" override), recursively inside lists, tuples, sets and dicts;
- builtins replaced by the program, and Python functions planted in ``math``/``cmath``, fail the
  run after the tests.

Fork-server mode (batch mode: the programs of a group follow each other in one sandbox): the
agent starts this script as root before any request exists; ``_fork_server`` loads nothing of any
request and, per run, receives the run's set-up and fds 0..4, forks twice (the program's process
is re-parented to the agent, which waits for it) and in the new process sets it up exactly as
the agent does before an exec (``agent.become``: own session, fds, workdir, rlimits, own IPC
namespace, the program's uid without capabilities) and returns: the process then runs
``main()`` below like a freshly started harness, minus the interpreter's start-up. Every
program thus starts from the same clean interpreter state; only the hash seed is shared.

Known limit: code running in the same interpreter can still read the test's values through
frames (``sys._getframe(1).f_locals``) or patch modules other than the checked ones.
"""

import ast
import builtins
import ctypes  # imported while the harness waits for its input: prctl in test mode
import os
import sys
import types
import warnings
from importlib.machinery import SourceFileLoader

FINISH = "temper.harness.finish"
NONCE_BYTES = 32
_DESTROY_EVENTS = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys.settrace",
                             "sys.setprofile", "ctypes.string_at", "ctypes.wstring_at", "ctypes.cdata",
                             "ctypes.cdata/buffer", "ctypes.call_function", "ctypes.PyObj_FromPtr",
                             "ctypes.addressof"})
_PLAIN = (int, float, complex, str, bytes, bytearray, bool, type(None), range)
_CHECKED_MODULES = ("math", "cmath")
_LIBC = ctypes.CDLL(None, use_errno=True)


def _read_into(buffer: bytearray) -> None:
    view, got = memoryview(buffer), 0
    while got < len(buffer):
        n = os.readv(3, [view[got:]])
        if n == 0:
            raise SystemExit("harness: control channel closed early")
        got += n


def _read_control():
    """(mode, nonce, test script); the nonce goes straight into its bytearray, no other copy."""
    mode = bytearray(4)
    _read_into(mode)
    nonce = bytearray(NONCE_BYTES)
    parts = []
    if mode == b"test":
        _read_into(nonce)
        while chunk := os.read(3, 1 << 16):
            parts.append(chunk)
    os.close(3)
    return bytes(mode).strip(), nonce, b"".join(parts).decode()


def _non_dumpable():
    """PR_SET_DUMPABLE 0: no ptrace attach or /proc/<pid>/mem from the program's helper processes."""
    _LIBC.prctl(4, 0, 0, 0, 0)


def _probe():
    class Unrelated:
        """A type the program has never seen: an honest value is never equal to it."""

    def claims_everything(value, depth=0):
        kind = type(value)
        if kind in (list, tuple, set, frozenset):
            return depth < 4 and any(claims_everything(v, depth + 1) for v in list(value)[:10_000])
        if kind is dict:
            return depth < 4 and any(claims_everything(k, depth + 1) or claims_everything(v, depth + 1)
                                     for k, v in list(value.items())[:10_000])
        if kind in _PLAIN:
            return False
        try:
            return bool(value == Unrelated()) or bool(Unrelated() == value)
        except Exception:  # noqa: BLE001 - a comparison that raises claims nothing
            return False

    def probe(left, right):
        result = left == right
        if result is not False and (claims_everything(left) or claims_everything(right)):
            raise AssertionError("a compared value claims to equal an unrelated object "
                                 "(an always-equal override), not a real answer")
        return result

    return probe


def _compile_tests(source: str, probe) -> types.CodeType:
    """Compile the test script with ``assert a == b`` routed through ``probe``."""
    marker = "__temper_probe_" + os.urandom(8).hex()

    class Rewrite(ast.NodeTransformer):
        def visit_Assert(self, node):
            self.generic_visit(node)
            test = node.test
            if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
                node.test = ast.copy_location(
                    ast.Call(func=ast.Constant(marker), args=[test.left, test.comparators[0]], keywords=[]), test)
            return node

    tree = ast.fix_missing_locations(Rewrite().visit(ast.parse(source, "<tests>")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)  # "'str' object is not callable": replaced below
        code = compile(tree, "<tests>", "exec")

    def swap(co):
        return co.replace(co_consts=tuple(
            probe if type(c) is str and c == marker else swap(c) if isinstance(c, types.CodeType) else c
            for c in co.co_consts))

    return swap(code)


def _install_guard(nonce: bytearray, main_code, module_code) -> None:
    """The audit hook that alone holds the nonce; see the module docstring."""
    import _thread

    write, fsdecode, getframe, get_ident = os.write, os.fsdecode, sys._getframe, _thread.get_ident
    main_thread = get_ident()
    state = {"spent": False}

    def wipe():
        nonce[:] = bytes(NONCE_BYTES)
        state["spent"] = True

    def hook(event, args):
        if event in _DESTROY_EVENTS:
            wipe()
        elif event == "open":
            path = args[0]
            if isinstance(path, (str, bytes)) and fsdecode(path).startswith("/proc/") and fsdecode(path).endswith("/mem"):
                wipe()
        elif event == "object.__setattr__" and len(args) > 1 and args[1] == "__code__":
            wipe()
        elif event == FINISH:
            caller = getframe(1)
            accepted = (not state["spent"] and get_ident() == main_thread and caller.f_code is main_code
                        and caller.f_back is not None and caller.f_back.f_code is module_code
                        and caller.f_back.f_back is None)
            if accepted:
                try:
                    write(4, bytes(nonce))
                except OSError:
                    pass
            wipe()

    sys.addaudithook(hook)


def _replaced_builtins(snapshot: dict) -> list[str]:
    current = vars(builtins)
    changed = [name for name, value in snapshot.items() if current.get(name, snapshot) is not value]
    for module_name in _CHECKED_MODULES:
        module = sys.modules.get(module_name)
        if module is not None:
            changed += [f"{module_name}.{k}" for k, v in vars(module).items()
                        if not k.startswith("_") and isinstance(v, types.FunctionType)]
    return changed


def _as_main(program_path: str) -> dict:
    """Make ``program_path`` the ``__main__`` module, as ``python3 program_path`` would; its namespace."""
    harness_file = __file__

    def excepthook(kind, value, tb):  # tracebacks show the program, not the harness
        while tb is not None and tb.tb_frame.f_code.co_filename == harness_file:
            tb = tb.tb_next
        sys.__excepthook__(kind, value.with_traceback(tb) if isinstance(value, BaseException) else value, tb)

    path = os.path.abspath(program_path)
    module = types.ModuleType("__main__")
    module.__file__, module.__cached__, module.__annotations__ = path, None, {}
    module.__loader__ = SourceFileLoader("__main__", path)
    module.__builtins__ = builtins
    sys.modules["__main__"] = module
    sys.argv = [program_path]
    sys.path[0] = os.path.dirname(os.path.abspath(program_path))
    sys.excepthook = excepthook
    return vars(module)


def main():
    mode, nonce, test_source = _read_control()
    program_path = sys.argv[1]
    try:
        with open(program_path, "rb") as f:
            program_code = compile(f.read(), os.path.abspath(program_path), "exec")
        test_code = _compile_tests(test_source, _probe()) if mode == b"test" else None
    except SyntaxError as e:
        import traceback

        traceback.print_exception(type(e), e, None)
        raise SystemExit(1) from None
    if test_code is None:  # run mode: the program, and nothing after it
        del nonce
        exec(program_code, _as_main(program_path))
        return
    _non_dumpable()
    _install_guard(nonce, main.__code__, sys._getframe(1).f_code)
    del nonce
    namespace = _as_main(program_path)
    snapshot = dict(vars(builtins))
    exec(program_code, namespace)
    exec(test_code, namespace)
    replaced = _replaced_builtins(snapshot)
    if replaced:
        raise SystemExit(f"harness: the program replaced {', '.join(sorted(replaced)[:10])}")
    sys.audit(FINISH)


def _fork_server():
    """Serve the agent's fork requests on fd 3; returns only in a run's process, set up as the run's.

    Per request: fork; answer the child's pid; wait for it; answer its exit status and rusage
    (the agent, pid 1, reaps whatever the program left behind).
    """
    import gc
    import json
    import socket

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import agent  # the one definition of a run's set-up

    del sys.path[0]
    become = agent.become
    del sys.modules["agent"]  # a program importing "agent" gets what it would get elsewhere
    sock = socket.socket(fileno=3)
    gc.collect()
    gc.freeze()  # a child's collections then leave the server's objects (and their pages) alone
    sock.send(b"ready")
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 8)
        except OSError:
            os._exit(0)
        if not message:
            os._exit(0)  # the agent is gone: so is the sandbox
        spec = json.loads(message)
        try:
            pid = os.fork()
        except OSError as e:
            for fd in fds:
                os.close(fd)
            sock.send(json.dumps({"error": f"fork: {e}"}).encode())
            continue
        if pid == 0:
            try:
                sock.close()
                become(spec["uid"], spec["limits"], dict(enumerate(fds)), spec["private"])
                os.environ.clear()
                os.environ.update(spec["env"])
                sys.argv = spec["argv"]
                return
            except BaseException as e:  # noqa: BLE001 - like the agent's exec failing: status 127
                try:
                    os.write(2, f"sandbox: cannot start the run: {e}\n".encode())
                finally:
                    os._exit(127)
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"pid": pid}).encode())
        _, status, usage = os.wait4(pid, 0)
        sock.send(json.dumps({"exited": pid, "status": status, "utime": usage.ru_utime, "stime": usage.ru_stime,
                              "maxrss": usage.ru_maxrss}).encode())


if sys.argv[1:] == ["--fork-server"]:
    _fork_server()
main()
