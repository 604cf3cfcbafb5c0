"""Starting processes: torchrun and its environment, the network addresses the machines use, the
node agent that runs torchrun on another machine, and the ways agents are started (ssh, srun,
locally). Knows nothing of cells; the controller drives it."""
