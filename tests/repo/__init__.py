"""Checks over the whole repository: the import graph, and the paths docs/ARCHITECTURE.md names."""
