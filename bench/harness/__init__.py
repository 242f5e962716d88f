"""What bench/'s scripts share, so that each script holds only what it measures.

- :mod:`harness.cli`: a benchmark's options (the usual ones by name), its results file, and
  where and how it ran (command line, commit, machine);
- :mod:`harness.engine`: the in-process ``Engine`` helpers (the bench document, full-KV sessions,
  timed decode steps and prefills, top operators);
- :mod:`harness.compare`: two or more ways of running the same thing, alternating (medians and
  ratios), the way every side-by-side benchmark here measures;
- :mod:`harness.service`: a local service (Ray, embedded Redis, Serve app) per phase, each phase
  in a process of its own.

A script under ``bench/<group>/`` runs as ``.venv/bin/python bench/<group>/<script>.py`` from the
repository root; its first lines put ``bench/`` on ``sys.path`` so that ``harness`` and the groups
(``peers``, ``reliability``) import by name.
"""
