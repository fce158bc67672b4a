"""Why a run stopped: the processes of a run watch each other and stop together (supervision), a failure's one
line and exit status (failure), a rank that hangs (hangs, heartbeat), what the ranks of a node share (node_board),
a device out of memory (out_of_memory)."""
