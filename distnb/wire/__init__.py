"""The wire both sides speak: message kinds and their typed bodies, signed framing, the ZMQ calls,
keys and CURVE, and a cell's compiled code. Imports nothing else of distnb but ``_text``; the rank
side and the controller each import only this from one another's world."""
