"""The tools that are not the service: the ``kvsnap`` command line (:mod:`.cli`), the quality
harness (:mod:`.quality`, :mod:`.tasks`) and the load generator (:mod:`.loadgen`). They call
the service or the engine, never the other way round."""
