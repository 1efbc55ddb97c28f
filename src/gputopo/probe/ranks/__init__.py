"""Code that runs inside torch's processes, and the only code in gputopo that imports torch.

``agent`` is the launcher process of one job (torch's elastic agent); ``worker`` is each rank's program.
The checks, one module each: ``p2p``, ``training`` (reference, DP, DDP), ``precision`` (dp/ddp at a
precision), ``allreduce``, ``speed``, ``crossnode`` (the tests across nodes); beside them ``context``
(what every check shares), ``amp``, ``models``, ``numerics`` and ``cuda`` (the parent's one question
to torch). The parent starts ``agent`` by module name and reads what the ranks wrote; it never
imports this room, except ``cuda``.
"""
