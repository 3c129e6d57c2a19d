"""Examples that run with logit-distill (importable from the repository root)."""
