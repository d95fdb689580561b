"""Generated gRPC code (`make proto`); sources in protos/specdec/proto/."""
