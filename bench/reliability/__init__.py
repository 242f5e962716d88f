"""The reliability and security suite (suite.py runs every phase; auth.py, fuzzing.py,
overload.py and faults.py each run their group alone): faults, overload and hostile input
against a real local service, with nothing lost."""
