"""``python -m distnb.node``: the node agent's command line, the one the join command prints.

The agent itself lives in :mod:`distnb.launching.node_agent`; this name stays short and stable
because users type it on their other machines."""

from __future__ import annotations

import sys

from distnb.launching.node_agent import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
