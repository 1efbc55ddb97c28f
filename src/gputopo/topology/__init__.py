"""Topologies as data, pure: ``parse_smi`` (saved ``nvidia-smi topo -m`` text), ``nccl_xml`` (NCCL's
topology dump), ``snapshot`` (gputopo's JSON, both ways), ``samples`` (built-in machines) and
``bandwidth`` (link -> GB/s, the ring model). Which of them a command reads, or the live machine, is
``gputopo.system.machine.load_topology``'s choice.
"""
