"""The model of how SPMD ranks must agree: every call a rank makes that others must match, as a
signature (:mod:`.calls`); the first place a group's members part (:mod:`.compare`); how the odd
rank's program differs from the majority's (:mod:`.programs`)."""
