"""Attention kernels over paged KV blocks: Triton for CUDA, pure-torch references for the CPU."""
