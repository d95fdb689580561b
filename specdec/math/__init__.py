"""The math: pure functions in the paper's notation (p = target, q = draft).

params.py and seeds.py need no torch (the coordinator uses them); sampling.py (logits processing, with
penalties.py: the penalties over the tokens before each position) and
rejection.py (lossless verification, per session and batched) are torch tensor functions with no I/O.
"""
