"""The minimal failing case: a session's cells as a script for torchrun and a notebook
(``export``), run once as its command runs to check it fails as the session did (``verify``),
cut down on the live pool (``minimize``: the case, the cuts read from the code, delta debugging),
and a torchrun script read back into cells (``script_cells``, ``reproduce``)."""
