"""Hang triage: PyTorch Flight Recorder dumps and NCCL RAS output -> the stuck collective and its suspects.

- ``load``: finding dumps and loading them safely (a restricted unpickler, JSON preferred, size caps);
- ``match``: the matching across ranks (pure);
- ``record``: the run record (``gputopo/run-record/v1``) that maps a rank to its host, GPU and PID;
- ``ras``: NCCL RAS (``ncclras -f json``) output, read from a file or asked of the local RAS port;
- ``triage``: verdicts, findings and the ``HangReport`` (its ``document()``: ``gputopo/hang/v1``);
  ``ui/hang_view`` and ``ui/hang_html`` render it;
- ``nccl_diag``: NCCL's ``NCCL DIAG`` lines (``--nccl-log``) as findings; ``oprules``: torch's per-op size
  rules; ``stacks``: the ranks' Python stacks, judged;
- ``files``: the one way its readers open a file an option names (``--ras-json``, ``--nccl-log``, a run
  record): capped, one ``InputError`` per failure;
- ``live``: a running job's stacks (``system/pyspy``) and dumps (torch's control plane) into its run folder.
- ``torch_check``: torch's own analyzer (``torch.distributed.flight_recorder``) as a second opinion,
  imported only when asked for.

``gputopo hang`` as one call (options in, a ``HangReport`` out) is ``services/hang.py``.

Nothing here imports torch at import time.
"""
