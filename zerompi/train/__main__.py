"""``mpiexec -n N python -m zerompi.train [flags]``: train a built-in model with ZeRO stage 0-3."""
import sys

from .run import main

sys.exit(main())
