"""The wire: the one gRPC server skeleton, command-line/environment configuration, and the prefix
fingerprints every SessionContext carries. The generated stubs live in specdec.proto. No torch."""
