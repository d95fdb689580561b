"""What every layer above the math shares and nothing of ours below it: request errors (a gRPC status and
a message) and the prefix fingerprints a SessionContext carries. No torch."""
