"""How results reach a person: plain text first (``text``), richer views on top of it."""
