"""Node health (pure): readings of what the driver knows is wrong, the rules that judge them (as data,
overridable), Xid lines from the kernel log, and golden baselines. The machine is read in
``gputopo.system.health_reads``; nothing here imports pynvml or runs a program."""
