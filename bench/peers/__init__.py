"""kvsnap against vLLM's CPU build on the same machine, model folder, client and requests:
peer_bench.py, beside it its two servers (servers.py), its decode workload (decode_workload.py)
and its figures and ratios (figures.py)."""
