"""``python -m zerompi.data prepare TEXT --out FILE``: a text file as a token file (no MPI needed)."""
import sys

from .prepare import main

sys.exit(main())
