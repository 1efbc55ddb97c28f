"""gputopo: GPU topology diagnostics and tuning for multi-GPU training machines.

Importing this package imports neither pynvml, torch nor rich, so every command starts fast.
"""

__version__ = "0.1.0"
