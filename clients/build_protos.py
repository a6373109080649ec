"""The one recipe that turns protos/temper/v1/*.proto into Python (``temper.v1``).

Used by the Makefile (``make protos``), by this package's build (``setup.py``) and so by every
image. Output: ``<out>/temper/v1/*_pb2.py, *_pb2_grpc.py, *_pb2.pyi`` and an ``__init__.py``.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def generate(proto_root: Path = HERE.parent / "protos", out_root: Path = HERE) -> Path:
    from grpc_tools import protoc  # build-time only (grpcio-tools)

    sources = sorted(str(p.relative_to(proto_root)) for p in (proto_root / "temper" / "v1").glob("*.proto"))
    if not sources:
        raise SystemExit(f"no .proto files under {proto_root / 'temper' / 'v1'}")
    target = out_root / "temper" / "v1"
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{proto_root}", f"-I{Path(protoc.__file__).parent / '_proto'}", f"--python_out={tmp}",
                f"--grpc_python_out={tmp}", f"--pyi_out={tmp}", *sources]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed (see above)")
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(Path(tmp) / "temper" / "v1", target)
    (target / "__init__.py").write_text('"""Generated from protos/temper/v1 by clients/build_protos.py; never edit."""\n')
    return target


if __name__ == "__main__":
    print(generate(*(Path(a).resolve() for a in sys.argv[1:3])))
