"""The embedded backend's fast path: a static KV cache, fixed-shape decode steps on the device, CUDA graphs."""
