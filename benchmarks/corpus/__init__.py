"""A mutation corpus for distnb's diagnosis: healthy SPMD programs covering the field's patterns,
mutated by rule (skip a call on one rank, an extra call, another group, peer, shape, dtype, op or
split, a raise, a swallowed exception, a rank condition, a loop bound per rank, an async call left
pending, a death), each mutant's truth known by construction. ``programs`` holds the programs,
``mutations`` the operators, ``runner`` runs them on a real pool and scores the verdicts."""
