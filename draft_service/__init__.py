"""The draft tier: a small model that proposes K tokens per round with their distributions q."""
