"""The setup model: what is being trained, how, and on what.

Three frozen dataclasses describe a run completely:

* :class:`ModelSpec` — the architecture (the numbers of a HF ``config.json``) and, derived from it, the
  exact shape of every parameter tensor (:meth:`ModelSpec.layer_params` and friends). The estimator,
  the model builder and the catalog all read shapes from here, so there is one definition of the model.
* :class:`TrainingSetup` — method, precisions, optimizer, LoRA, batch, sequence, checkpointing,
  attention kernel, sharding. Precision is not one switch: weight storage, compute dtype, fp32 master
  weights, gradient dtype and optimizer-state dtype are separate facts (the last two are derived and
  reported in :meth:`TrainingSetup.resolved`).
* :class:`GpuSpec` — a device: name, memory, bf16 peak TFLOP/s.

Invalid combinations raise :class:`~vramlab.core.checks.SetupError` whose message says what to change.

The package holds one module per part: :mod:`.options` (the switches of a run: method, dtypes, optimizer,
attention, sharding, objective), :mod:`.targets` (LoRA's target module names), :mod:`.model` (``ModelSpec`` and
its shapes), :mod:`.gpu`, :mod:`.training` (``TrainingSetup`` and its validation), :mod:`.edits` (what follows
from an edit, and settings read back value by value) and :mod:`.presets` (the precision presets).
"""
