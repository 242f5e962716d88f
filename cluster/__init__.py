"""Running kvsnap on a Ray cluster of GPU spot instances: ``aws.yaml`` (``ray up``), ``serve.yaml``
(``serve deploy``), the operator's README, and the spot-preemption watcher (:mod:`.spot`,
``kvsnap spot-watch``)."""
