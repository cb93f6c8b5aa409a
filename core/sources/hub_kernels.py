"""Whether a framework's run loads its model with transformers' Hub kernels (``hub_kernels``,
core/spec/hub_kernels.py): ``from_pretrained`` turns them on by default from transformers 5.25.0, so the answer is
the framework's own ``use_kernels`` where it passes one, else the default of the transformers release it installs
(read from the frameworks' requirements at the versions in :mod:`.defaults`)."""

from __future__ import annotations

from vramlab.core.sources.defaults import VERSIONS
from vramlab.core.sources.mapping import ABSENT, ConfigFile
from vramlab.core.spec.hub_kernels import SINCE

_DEFAULT_ON = f"transformers >= {SINCE}'s from_pretrained default (use_kernels on; USE_HUB_KERNELS=NO turns it off)"


def read_trl(f: ConfigFile, v: str) -> None:
    """TRL passes ``model_init_kwargs`` to ``from_pretrained`` (its trainers' ``use_kernels`` is that key); unset,
    transformers' default holds (TRL 1.16.0 accepts transformers 5.25)."""
    key = "model_init_kwargs.use_kernels"
    value = f.bool(key)
    if value is ABSENT:
        f.default(key, "hub_kernels", True, note=f"{v}: {_DEFAULT_ON}")
    else:
        f.put(key, "hub_kernels", value, note="passed to from_pretrained")


def read_axolotl(f: ConfigFile) -> None:
    """axolotl 0.19.0 passes ``use_kernels`` to ``from_pretrained`` only when the config turns it on, and pins
    transformers 5.16.1, whose ``from_pretrained`` keeps the Hub kernels off unless asked."""
    value = f.bool("use_kernels")
    if value is True:
        f.put("use_kernels", "hub_kernels", True, note=f"transformers {SINCE}'s kernel mapping modelled (axolotl "
                                                       f"{VERSIONS['axolotl']} installs 5.16.1)")
    elif value is ABSENT:
        f.default("use_kernels", "hub_kernels", False,
                  note=f"axolotl {VERSIONS['axolotl']} installs transformers 5.16.1: off unless asked")
    else:
        f.put("use_kernels", "hub_kernels", False)


def read_llamafactory(f: ConfigFile) -> None:
    """LLaMA-Factory 0.9.5 passes no ``use_kernels`` and installs transformers <= 5.6.0, whose ``from_pretrained``
    keeps the Hub kernels off; its ``use_v1_kernels`` is its own kernel plugin (not modelled)."""
    f.default("use_kernels", "hub_kernels", False,
              note=f"LLaMA-Factory {VERSIONS['llamafactory']} installs transformers <= 5.6.0: off")
    f.not_modelled("use_v1_kernels", note="LLaMA-Factory's own kernel plugin")


def read_swift(f: ConfigFile) -> None:
    """ms-swift 4.6.0 passes no ``use_kernels`` and installs transformers < 5.20.0, whose ``from_pretrained`` keeps
    the Hub kernels off."""
    f.default("use_kernels", "hub_kernels", False,
              note=f"ms-swift {VERSIONS['ms-swift']} installs transformers < 5.20.0: off")
