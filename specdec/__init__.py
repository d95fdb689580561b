"""specdec: distributed speculative decoding. This package is the core shared by all tiers."""

__version__ = "0.1.0"
