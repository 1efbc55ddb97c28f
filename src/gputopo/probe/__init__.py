"""``gputopo probe``: short, data-checked training and communication probes on GPU sets.

Design: one launch per run. ``torch.distributed.run`` starts one rank per GPU of the union of all sets,
once (starting ranks, a CUDA context and an NCCL communicator costs more than most checks). Each set is a
process subgroup (``new_group``) of that pool. The plan is a schedule of steps: the correctness checks
(dp, ddp) of disjoint sets share a step and run at the same time; the checks that time bandwidth (p2p,
the all-reduce sweep) are alone in theirs; a barrier separates steps. DataParallel runs inside the pool,
in the set's first rank, which sees every GPU of the pool. The parent times each step: a set that runs
past ``--timeout`` is ``hung``, a rank that dies makes its set ``crashed``; either way the pool is
stopped (no process left behind) and a fresh pool runs the sets not yet judged, so a fault costs one
set, not the run.

Layout, by where the code runs: ``plan/`` (what to run, pure), ``ranks/`` (inside torch's processes: the
agent, the worker and the checks; the only torch importer), ``pool/`` (starting, watching and stopping
ranks, on one node and across nodes), ``judge/`` (measurements -> verdicts, pure), ``report/`` (JSON and
Markdown), and ``shared`` (what several of them hand around). ``import gputopo.probe`` stays cheap.
"""
