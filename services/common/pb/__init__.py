"""Generated gRPC stubs for epd.v1 (see services/common/protogen.py)."""
