"""Stand-in for flash-attn (CUDA only)."""
