"""``gputopo slow``: which rank makes a running or finished job slow, from NCCL Inspector logs, Flight
Recorder creation times or an nccl-tests ``-J`` file. ``judge`` is the pure statistics; ``readers`` turn
each source into operations; ``service`` finds the sources in a run folder and places the ranks."""
