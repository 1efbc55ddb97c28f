"""Starting, watching and stopping ranks, on one node and across nodes: ``devices`` (what can be
probed here), ``launch`` (one start of torch's agent, and stopping it), ``pool`` (the rank pool on one
machine), ``runner`` (a whole probe: pools until every set is judged), ``multinode`` (this node's part
of a run across nodes). This is the probe's orchestration: it plans with ``plan``, judges with
``judge`` and documents with ``report``.
"""
