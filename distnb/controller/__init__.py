"""The controller's live state in the notebook process: the ROUTER channel and its I/O thread, the
request table, the tracker (every rank's state, changed in one place), a cell in flight, deaths in
order, the collective log the ranks push, the session log for replay and export."""
