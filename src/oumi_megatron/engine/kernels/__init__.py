"""Compute on one rank: attention cores, RoPE, SwiGLU, norms, chunked logprobs, Megatron-Core's fusions
supplied from PyTorch/Triton, and CUDA graphs."""
