"""``gputopo probe``: short, data-checked training and communication probes on GPU sets.

Layout: ``config`` (frozen options, built without touching a GPU), ``plan`` (which sets, checks and
rounds), ``launch`` (the torch elastic launcher, timeouts and clean-up), ``worker`` and ``checks`` (run
inside the ranks), ``verdict`` (pure judging), ``document`` (JSON and Markdown), ``runner`` (the service
the CLI calls). torch is imported only inside functions here, so ``import gputopo.probe`` stays cheap.
"""
