"""Where a run comes from: a model on the Hugging Face Hub (:mod:`.hub`) and the training-framework configs
that describe the rest of the setup (axolotl, LLaMA-Factory, TRL / transformers, peft, DeepSpeed, accelerate:
read in by :mod:`.training`, written out by :mod:`.export`). Documented in docs/sources.md.

Local presets, ``config.json`` files and model folders are read by :mod:`vramlab.core.importer` and
:mod:`vramlab.core.catalog`; the Hub reader calls into the importer for the same mapping and checks.
Everything a user gives is parsed as data: JSON, ``yaml.safe_load``, safetensors headers; never code.
"""
