"""``gputopo accept``'s pure parts: the floors per GPU model (data, ``floors.json``), each step's judgement
and the one verdict (``steps``), and the verdict as the check state keeps it (``record``).

The service that runs the steps on the machine is ``gputopo.services.accept``.
"""

# accept's defaults (the budget's lives in gputopo.model, which the CLI may import: --help stays light).
from gputopo.model import DEFAULT_ACCEPT_BUDGET_S as DEFAULT_BUDGET_S

DEFAULT_REPORT_DIR = "reports"  # as probe's and doctor's (probe.plan.options.DEFAULT_REPORT_DIR)

__all__ = ["DEFAULT_BUDGET_S", "DEFAULT_REPORT_DIR"]
