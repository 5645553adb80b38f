"""``python -m zerompi.plot RUN.json [RUN.json ...] [--out PNG]``: one figure of a train run."""
import sys

from .figure import main

sys.exit(main())
