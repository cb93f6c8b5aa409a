"""See :mod:`vramlab.core.objectives.registry`."""
