"""Hang triage: PyTorch Flight Recorder dumps and NCCL RAS output -> the stuck collective and its suspects.

- ``load``: finding dumps and loading them safely (a restricted unpickler, JSON preferred, size caps);
- ``match``: the matching across ranks (pure);
- ``record``: the run record (``gputopo/run-record/v1``) that maps a rank to its host, GPU and PID;
- ``ras``: NCCL RAS (``ncclras -f json``) output, read from a file or asked of the local RAS port;
- ``triage``: verdicts, findings and the ``gputopo/hang/v1`` document; ``render`` the text output,
  ``html`` the HTML report; ``service``: all of it as one call (``analyse``);
- ``torch_check``: torch's own analyzer (``torch.distributed.flight_recorder``) as a second opinion,
  imported only when asked for.

Nothing here imports torch at import time.
"""
