"""Output: one object owns the consoles (``output``); rich renderers per command (``render``)."""
