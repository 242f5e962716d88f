"""Tests of policies/: the compression and eviction policies, their math and their contract."""
