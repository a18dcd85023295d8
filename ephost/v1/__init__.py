"""Generated protobuf and gRPC modules for the wire contract in protos/ephost/v1 (`make proto`)."""
