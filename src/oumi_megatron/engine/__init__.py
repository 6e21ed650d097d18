"""The training engine: process groups, the Megatron-Core model (built through Megatron-Bridge),
optimizer and schedules, checkpoints. Everything here runs on CPU (gloo) and on GPUs (NCCL)."""
