"""``python -m distnb.worker``: the per-rank entry point that torchrun starts."""

import sys

from distnb.worker.process.supervisor import main

sys.exit(main())
