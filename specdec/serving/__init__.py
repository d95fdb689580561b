"""Serving: the one gRPC server skeleton (server.py), the bearer-token check (auth.py), command-line flags
(flags.py), Prometheus metrics (metrics.py), structured logs (logs.py), and what the two tiers' servers share
(tier.py: the per-session stream loop, common rpcs and checks; draft_probs.py: q's wire codec). Above the
engine, below the coordinator; only tier.py and draft_probs.py touch the engine (and torch)."""
