"""Generates the Python gRPC stubs in ``services/common/pb`` from ``protos/``.

One protoc run writes the messages (``epd_pb2.py`` and its ``.pyi``), the
service stubs and servicers (``epd_pb2_grpc.py``) and their types
(``epd_pb2_grpc.pyi``, from mypy-protobuf's ``protoc-gen-mypy_grpc``): mypy
checks every gRPC call against the latter. grpcio-tools and mypy-protobuf are
pinned in pyproject's ``test`` and ``lint`` extras, so a regeneration is the
same everywhere.

The stubs are committed so that a plain ``pip install`` needs no code
generation; ``tests/unit/common/test_protos.py`` fails when they drift from the
``.proto`` files. Regenerate with ``python -m services.common.protogen``.
"""

from __future__ import annotations

import re
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parents[2] / "protos"
PB_DIR = Path(__file__).resolve().parent / "pb"
PROTO_FILES = ("epd/v1/epd.proto",)


MYPY_GRPC_PLUGIN = "protoc-gen-mypy_grpc"


def _mypy_grpc_plugin() -> Path:
    """mypy-protobuf's protoc plugin: beside this interpreter (an inactive venv), else on PATH."""
    beside = Path(sysconfig.get_path("scripts")) / MYPY_GRPC_PLUGIN
    found = beside if beside.is_file() else shutil.which(MYPY_GRPC_PLUGIN)
    if found is None:
        raise RuntimeError(f"{MYPY_GRPC_PLUGIN} not found: install mypy-protobuf (pyproject's test or lint extra)")
    return Path(found)


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc into ``out_dir`` and rewrites imports to be package-relative."""
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as raw:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--plugin={MYPY_GRPC_PLUGIN}={_mypy_grpc_plugin()}",
            f"--python_out={raw}",
            f"--pyi_out={raw}",
            f"--grpc_python_out={raw}",
            f"--mypy_grpc_out={raw}",
            *PROTO_FILES,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed")
        written = []
        for src in sorted(Path(raw).rglob("*.py*")):
            text = src.read_text()
            # protoc emits "from epd.v1 import epd_pb2"; our stubs live in a
            # flat package, so the import must be relative to it.
            text = re.sub(r"^from epd\.v1 import (\w+)", r"from . import \1", text, flags=re.M)
            dst = out_dir / src.name
            dst.write_text(text)
            written.append(dst)
    return written


def main() -> int:
    PB_DIR.mkdir(exist_ok=True)
    for path in generate(PB_DIR):
        print(f"wrote {path.relative_to(PB_DIR.parents[2])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
