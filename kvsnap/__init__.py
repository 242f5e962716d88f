"""kvsnap: long-context inference with SnapKV-compressed, session-affine KV caches.

The code lives in the top-level folders of the repository and is installed under
this package name (see ``[tool.setuptools.package-dir]`` in pyproject.toml):

- ``kvsnap.policies`` -> ``policies/``  KV compression policies (pure torch), registered by name
- ``kvsnap.engine``   -> ``engine/``    one model on one session's KV: prefill, compress, decode
- ``kvsnap.store``    -> ``store/``     the tiered KV store and the Redis session directory
- ``kvsnap.actors``   -> ``actors/``    the worker replica: turn contract, worker, session store
- ``kvsnap.service``  -> ``service/``   the Ray Serve application (HTTP, gRPC, routing)
- ``kvsnap.tools``    -> ``tools/``     the ``kvsnap`` CLI, quality harness, load generator
- ``kvsnap.cluster``  -> ``cluster/``   cluster configs and the spot watcher

docs/ARCHITECTURE.md has the path of one turn through them.
"""

__version__ = "0.1.0"
