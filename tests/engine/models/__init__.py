"""Tests of engine/models/: the dtype, and the bf16 CPU patching (packed linears, fused ops, lean layers, LM head)."""
