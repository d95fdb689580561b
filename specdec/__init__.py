"""specdec: distributed, lossless speculative decoding.

The package is layered, each layer in its own folder:
  math/     pure functions: sampling parameters, seeds, logits processing, rejection sampling
  core/     request errors and prefix fingerprints, shared by every layer above the math (no torch)
  engine/   the tier engine: model runner, KV memory, sessions, the batching step loop (torch)
  serving/  the gRPC server skeleton, auth, flags, metrics, logs, the tiers' shared server parts
  client/   the Python client, the CLI and the local runner (no torch)
  proto/    generated gRPC stubs
models.py says where models come from and loads tokenizers (torch only to load weights).
tests/test_layering.py pins the order: math < core < engine < serving < tiers < coordinator, client.
"""

__version__ = "0.1.0"
