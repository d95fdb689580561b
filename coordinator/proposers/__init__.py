"""The coordinator's proposers wing: where draft tokens come from, as strategies behind one interface.

strategy.py     the interface (predict, propose, observe) and what passes through it
policy.py       the per-round pick: the most predicted tokens per predicted second, K = 0 included
tier_cost.py    what a tier's step costs at its current load (its measured curve, refined by its replies)
coordinator_cost.py  the coordinator's own CPU per tier call, in the same prices
estimates.py    the small online estimates strategies are made of, and the priors sessions hand on
local.py        what the model-free strategies share; lookup.py (prompt lookup), suffix.py (suffix decoding)
draft_model.py  the draft tier's model; draft_tree.py its token trees' shapes and estimates
drafter.py      one session's strategies and policy: the round loop's propose / observe / commit
base.py (Proposal); token_tree.py, ngram_index.py, suffix_tree.py, suffix_cache.py (the shared tree of recent
outputs): data structures
"""
