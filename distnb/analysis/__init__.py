"""Pure analyses: data in, findings out. Stacks, collective logs, checksums, memory samples and
profiles become verdicts (a hang's cause, a desync, a straggler, an odd rank), each with a plain
text form. Nothing here talks to a rank or holds the pool's state."""
