"""The committed stubs match what protoc generates from protos/ today."""

from pathlib import Path

import pytest

from services.common import protogen


def test_generated_stubs_match_proto_files(tmp_path: Path):
    pytest.importorskip("grpc_tools")
    pytest.importorskip("mypy_protobuf")
    written = protogen.generate(tmp_path)
    # Messages and their types (protoc), stubs and servicers (grpc) and their types (mypy-protobuf).
    assert sorted(p.name for p in written) == ["epd_pb2.py", "epd_pb2.pyi", "epd_pb2_grpc.py", "epd_pb2_grpc.pyi"]
    for fresh in written:
        committed = protogen.PB_DIR / fresh.name
        assert committed.exists(), f"{fresh.name} is not committed; run python -m services.common.protogen"
        assert committed.read_text() == fresh.read_text(), (
            f"{fresh.name} drifted from protos/; run python -m services.common.protogen"
        )


def test_stubs_import_and_expose_both_services():
    from services.common.pb import epd_pb2, epd_pb2_grpc

    assert epd_pb2.DESCRIPTOR.package == "epd.v1"
    names = {s.name for s in epd_pb2.DESCRIPTOR.services_by_name.values()}
    assert names == {"PrefillDecode", "Encoder"}
    assert hasattr(epd_pb2_grpc, "PrefillDecodeStub") and hasattr(epd_pb2_grpc, "EncoderStub")
