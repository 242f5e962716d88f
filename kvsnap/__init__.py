"""kvsnap: long-context inference with SnapKV-compressed, session-affine KV caches.

The code lives in the top-level folders of the repository and is installed under
this package name (see ``[tool.setuptools.package-dir]`` in pyproject.toml):

- ``kvsnap.policies`` -> ``policies/``  KV compression policies (pure torch)
- ``kvsnap.actors``   -> ``actors/``    model worker: models, session KV, engine
- ``kvsnap.service``  -> ``service/``   CLI and (later) the Ray Serve application
"""

__version__ = "0.1.0"
