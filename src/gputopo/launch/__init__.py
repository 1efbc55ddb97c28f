"""How a job starts: ``line`` (the torchrun line, NUMA binding, NICs, environment: pure), ``slurm``
(a Slurm job's nodes and rendezvous, from its environment: pure) and ``command`` (what ``gputopo run``
and ``recommend --launch`` add: the user's command checked, NCCL settings warned about, tools found).
"""
