"""The std Megatron's default init draws each dense weight from, as the saved args configure it.

One rule for ``check --health`` (a layer still at its init while the others moved) and ``verify-export --values``
(an export tensor re-initialised): megatron-core's ``TransformerConfig`` draws weights from normal(0,
``init_method_std``) and the output layers (``linear_proj``, ``linear_fc2``) from normal(0, ``init_method_std /
sqrt(2 num_layers)``) (``sqrt(num_layers)`` for a hybrid model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

DEFAULT_INIT_METHOD_STD = 0.02  # Megatron-LM's --init-method-std default (TransformerConfig.init_method_std)


@dataclass(frozen=True)
class InitStds:
    """The std Megatron draws each dense weight from, for one set of saved args."""

    weight: float  # init_method: normal(0, init_method_std)
    output: float  # output_layer_init_method: normal(0, init_method_std / sqrt(multiplier num_layers))

    def both(self) -> tuple[float, float]:
        return (self.weight, self.output)


def megatron_init_stds(args: dict[str, Any]) -> InitStds | None:
    """From the saved args (TransformerConfig.__post_init__'s rule); None without ``num_layers``, or where the
    args choose another init than Megatron's normal ones (muP, Xavier)."""
    num_layers = args.get("num_layers")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        return None
    if args.get("use_mup") or args.get("init_method_xavier_uniform"):
        return None
    std = args.get("init_method_std")
    if std is None:
        std = DEFAULT_INIT_METHOD_STD
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not std > 0:
        return None
    multiplier = 1.0 if args.get("hybrid_override_pattern") else 2.0  # is_hybrid_model: sqrt(num_layers)
    return InitStds(float(std), float(std) / math.sqrt(multiplier * num_layers))
