"""The coordinator: owns every session's committed tokens and runs the speculative round loop.

  generation.py  the round loop (propose -> verify -> accept -> commit -> emit), its collaborators passed in
  output.py, text.py  stop / EOS / budget cuts, incremental detokenizing, streaming
  stats.py       a generation's counters and per-round records; metrics.py: its Prometheus series
  params.py      a validated request; config.py: the coordinator's configuration
  pipeline.py    the connections to the tiers, and the factory of a generation's collaborators
  service.py     build(): the gRPC server over the API wing
  api/           the public APIs: gRPC, OpenAI-compatible HTTP, validation, admission
  proposers/     the one table of proposer names; lookup, suffix, draft model, the policy (adaptive K)
  tiers/         routing to replicas, a tier's client and streams, a session's cursor, retries, the target
"""
