"""The coordinator's proposers wing: where draft tokens come from.

names.py     the one table of proposer names (API, OpenAI schema, CLI, Python client)
base.py      Proposal: what every proposer returns
lookup.py    prompt lookup (n-gram) over the session's own tokens
suffix.py    suffix decoding over the session's tokens and recent outputs
draft_model.py  the draft tier's model, with its prefetch (the overlap)
adaptive.py, policy.py  the estimates and the per-round choice of proposer and K
drafter.py   one session's proposers and policy: the round loop's `propose`
"""
