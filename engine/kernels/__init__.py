"""Triton kernels for the CUDA path."""
