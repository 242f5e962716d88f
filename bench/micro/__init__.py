"""In-process microbenchmarks: one kernel, engine path or store change on and off, side by side
in one run (``Engine``, ``Scheduler`` or the tiered store, no service). Each script runs alone:
``.venv/bin/python bench/micro/<script>.py --help``."""
