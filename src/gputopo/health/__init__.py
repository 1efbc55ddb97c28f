"""Node health (pure): readings of what the driver knows is wrong, the rules that judge them (as data,
overridable; each row makes its findings, ``Rule.finding``), Xid lines from the kernel log, golden
baselines, and configuration drift across nodes (``drift``, shared by probe and hang). The machine is read in
``gputopo.system.health_reads``; nothing here imports pynvml or runs a program."""
