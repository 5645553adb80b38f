"""``mpiexec -n N python -m zerompi.bench [flags]``: microbenchmark the collectives zerompi uses."""
import sys

from .run import main

sys.exit(main())
