"""The seam under the Pool: a launch's ranks, the wire to them, and how a launch starts and ends."""
