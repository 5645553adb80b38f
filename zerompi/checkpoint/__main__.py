"""``python -m zerompi.checkpoint inspect DIR | consolidate DIR OUT.npz`` (no MPI needed)."""
import sys

from .cli import main

sys.exit(main())
