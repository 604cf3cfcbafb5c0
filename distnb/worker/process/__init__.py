"""The rank side's processes and threads: the supervisor torchrun starts, the rank process it
starts, the rank's control thread, and the executor that runs cells in the rank's namespace (with
its debugger, the debugger panel's link, and the quiet path for a silent cell's CELL_DONE)."""
