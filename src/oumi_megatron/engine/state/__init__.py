"""Weights on disk and in flight: HF -> Megatron conversion, distributed checkpoints, HF export."""
