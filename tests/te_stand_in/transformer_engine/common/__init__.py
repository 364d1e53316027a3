"""Stand-in for transformer_engine.common."""
