"""``python -m kvsnap.cpu_kernels``: build every kernel variant now (cpu_kernels/build.py ``main``)."""

import sys

from .build import main

sys.exit(main())
