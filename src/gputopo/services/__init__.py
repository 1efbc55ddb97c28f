"""Where a command's work lives between its options and its output: one module per command, each with a
frozen keyword-only ``Options`` validated once (``__post_init__``), typed ``Hooks`` (callbacks, never a
console or a typer object) and ``run(options, hooks) -> Report`` whose ``document()`` is the command's
whole JSON and ``exit_code`` its exit status. ``cli/`` builds the ``Options``, calls ``run`` and hands the
report to ``cli/finish``.

- the commands: ``topo``, ``recommend``, ``run``, ``probe``, ``doctor`` (and ``report``), ``check``,
  ``accept``, ``stale`` (kill-stale), ``hang``, ``slow``, ``nodes``;
- what several share: ``machine`` (the one machine step: the topology, one health sample, the drain rule,
  the preset ``CUDA_VISIBLE_DEVICES``), ``fabric`` (network ports and the PCIe path table, for check,
  doctor, topo and recommend), ``across_nodes`` (where a run across nodes meets: Slurm, the rendezvous),
  ``hooks`` (the shared ``Warn`` callbacks).

``services`` imports no ``cli``, ``ui``, typer or rich; no domain package imports ``services``
(import-linter contracts in ``pyproject.toml``).
"""
