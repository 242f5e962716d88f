"""Tests of engine/: turns, batching, prefixes, replay and the forward pass on a compressed cache."""
