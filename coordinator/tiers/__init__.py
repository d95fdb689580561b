"""The coordinator's tiers wing: how a session reaches the draft and target tiers. routing.py (which
replica: gRPC's ring hash by session id), client.py (a tier's channel and a session's stream on it),
cursor.py (what a tier caches of a session), session.py (one session on one tier: retries, re-prefills,
back-off), target.py (the target's Verify as the round loop calls it)."""
