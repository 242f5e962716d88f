"""Tests of store/: tiered session KV, the Redis session directory, the prefix holders."""
