"""``python -m zerompi.run -n N [--max-restarts K] [--shrink] -- <train flags>``: a job that carries on."""
import sys

from .supervisor import main

sys.exit(main())
