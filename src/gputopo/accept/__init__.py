"""``gputopo accept``'s pure parts: the floors per GPU model (data, ``floors.json``), each step's judgement
and the one verdict (``steps``), and the verdict as the check state keeps it (``record``).

The service that runs the steps on the machine is ``gputopo.services.accept``.
"""
