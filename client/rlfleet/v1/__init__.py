"""Generated protobuf/gRPC stubs (do not edit; run scripts/gen-protos)."""
