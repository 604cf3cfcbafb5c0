"""What the notebook looks into besides the pool it launched, and which one it looks into now: the
registry of live pools (``pools``), a running job distnb did not launch, attached (``attached``), and a
job that ended, read from the files it left (``loaded``)."""
