"""Triton kernels for the CUDA path; C++ kernels for the CPU path (cpu_kernels.py)."""
