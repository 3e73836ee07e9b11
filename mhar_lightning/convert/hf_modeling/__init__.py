"""Modeling code copied into routed Hugging Face exports; it imports only torch and transformers."""
