"""specdec: distributed, lossless speculative decoding.

The package is layered, each layer in its own folder:
  math/    pure functions: sampling parameters, seeds, logits processing, rejection sampling
  engine/  the tier engine: model runner, KV memory, sessions, the batching step loop (torch)
  wire/    the gRPC server skeleton, configuration flags, prefix fingerprints (no torch)
  client/  the Python client, the CLI and the local runner (no torch)
  proto/   generated gRPC stubs
models.py says where models come from and loads tokenizers (torch only to load weights).
"""

__version__ = "0.1.0"
