"""Helpers that build tiny models and tokenizers locally (tests, the CPU demo): no downloads."""
