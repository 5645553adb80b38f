"""``python -m zerompi.estimate --params 10e9 --ranks 64``: memory and traffic per rank (no MPI needed)."""
import sys

from .cli import main

sys.exit(main())
