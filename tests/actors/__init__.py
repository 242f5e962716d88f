"""Tests of actors/: a worker rebuilding a lost session from its token log, and its turn claims.
No test here may use the shared service fixture: tests/bench/ runs after this folder and before
the fixture starts."""
