"""Training for draft heads: specdec.training.eagle3 trains an EAGLE-3 head for a target (`make eagle-head`)."""
