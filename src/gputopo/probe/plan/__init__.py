"""What a probe runs, pure: the frozen options (``config``, ``options``), the GPU identity rule
(``identity``: CUDA's numbering against nvidia-smi's), the schedule of jobs (``schedule``), what each
job's ranks are given (``spec``), a node's place across nodes (``nodes``), and ``--dry-run``'s
document (``dryrun``). Nothing here starts a process or touches a GPU.
"""
