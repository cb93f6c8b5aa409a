"""Where a run comes from: a model on the Hugging Face Hub (:mod:`.hub`) and the training-framework configs
that describe the rest of the setup (axolotl, LLaMA-Factory, TRL / transformers, peft, DeepSpeed, accelerate:
read in by :mod:`.training`, written out by :mod:`.export`). Documented in docs/sources.md. The reading is
one module per dialect: :mod:`.axolotl`, :mod:`.llamafactory`, :mod:`.trainer` (transformers and TRL),
:mod:`.launchers` (peft, DeepSpeed, accelerate) and :mod:`.swift`, on the shared :mod:`.mapping` (the rows and
one file's keys) and :mod:`.keys` (readers several dialects share); :mod:`.config_file` reads a file as data.

A model's own files are read here too, one job a module: :mod:`.files` reads ``config.json`` and the
safetensors headers safely, :mod:`.hf_config` maps a config to a ModelSpec, :mod:`.remote_code` says when a
config needs code transformers does not ship (and counts such a model from its headers), and :mod:`.folder`
turns a model folder into an ImportedModel (presets and the resolution of a name: :mod:`vramlab.core.catalog`).
The Hub reader calls into the same mapping and checks.
Everything a user gives is parsed as data: JSON, ``yaml.safe_load``, safetensors headers; never code.
"""
