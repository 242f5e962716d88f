"""Tests of tools/: kvsnap serve, kvsnap eval, the load generator."""
