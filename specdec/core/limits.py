"""Limits both ends of the wire hold to: the tier enforces them, the coordinator checks its settings against them
at start."""

MAX_RUN_ON = 64  # tokens a VerifyRequest may decode on after its verdict (run_on_seeds)
