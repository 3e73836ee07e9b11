"""mhar-lightning: decoder-only transformers whose residual connection is a plugin."""
