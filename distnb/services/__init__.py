"""Services over the controller's state, each built from the parts it uses (tracker, session log,
config, callables), never from the Pool: diagnostics that ask the ranks, the debugger's prompts,
values to and from the ranks, waiting for a cell, starting and restarting, the pool across
machines, export."""
