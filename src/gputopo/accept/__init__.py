"""``gputopo accept``'s pure parts: the floors per GPU model (data, ``floors.json``), each step's judgement
and the one verdict (``steps``), and the verdict as the check state keeps it (``record``).

The service that runs the steps on the machine is ``gputopo.services.accept``.
"""

# accept's defaults, written once (light: the CLI declares its options with them without loading the rest).
DEFAULT_BUDGET_S = 1800.0
DEFAULT_REPORT_DIR = "reports"
