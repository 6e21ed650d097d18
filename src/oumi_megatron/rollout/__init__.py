"""Rollout backends: generate completions for prompts. The embedded Megatron backend samples from the
policy's own Megatron-Core weights (no copy, so no weight sync)."""
