"""Where a command's work lives between its options and its output: one module per command,
each with a frozen keyword-only ``Options`` validated once, and ``run(options, hooks) -> Report`` whose
``document()`` is the command's whole JSON and ``exit_code`` its exit status. ``services`` imports no
``cli``, ``ui``, typer or rich; no domain package imports ``services``.
"""
