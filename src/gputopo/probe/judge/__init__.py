"""Measurements in, verdicts out, pure and without torch: ``verdict`` (the training and all-reduce
checks, hangs and crashes), ``p2p``, ``precision``, ``speed``, ``environment`` (NCCL settings and
transports), ``nodes`` and ``progress`` (across nodes), ``failures`` (which rank failure is the root
cause), ``findings`` (a probe document's failed checks as findings, for doctor and probe).
"""
