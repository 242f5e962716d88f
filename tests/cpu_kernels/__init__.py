"""Tests of cpu_kernels/: the C kernels against torch, and their build per ISA variant."""
