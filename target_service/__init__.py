"""The target tier: the large model that verifies K draft tokens per round in one forward pass."""
