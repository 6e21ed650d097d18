"""oumi-megatron: a Megatron-Core GRPO trainer (``MEGATRON_GRPO``) for Oumi.

This package is imported at interpreter start-up by a one-line ``.pth`` hook (see
``_oumi_hook.py``), so importing it must stay cheap: public names are resolved lazily.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY_EXPORTS = {
    "MegatronParams": "oumi_megatron.config.megatron_params",
    "MegatronGrpoParams": "oumi_megatron.config.grpo_params",
    "RewardFunctionParams": "oumi_megatron.config.grpo_params",
    "MegatronTrainingConfig": "oumi_megatron.config.training_config",
    "check_megatron_bridge_available": "oumi_megatron.bridge_utils",
    "validate_config": "oumi_megatron.validation",
    "ValidationReport": "oumi_megatron.validation",
    "ParallelLayout": "oumi_megatron.engine.parallel.layout",
    "ModelShape": "oumi_megatron.model_shape",
    "convert_hf_to_megatron": "oumi_megatron.engine.state.conversion",
    "export_to_hf": "oumi_megatron.engine.state.conversion",
    "MegatronEngine": "oumi_megatron.engine.engine",
    "build_engine": "oumi_megatron.engine.builder",
}

__all__ = sorted(_LAZY_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover
    # ``X as X``: an explicit re-export for type checkers and linters (``__all__`` above is computed)
    from oumi_megatron.bridge_utils import check_megatron_bridge_available as check_megatron_bridge_available
    from oumi_megatron.config.grpo_params import MegatronGrpoParams as MegatronGrpoParams
    from oumi_megatron.config.grpo_params import RewardFunctionParams as RewardFunctionParams
    from oumi_megatron.config.megatron_params import MegatronParams as MegatronParams
    from oumi_megatron.config.training_config import MegatronTrainingConfig as MegatronTrainingConfig
    from oumi_megatron.engine.builder import build_engine as build_engine
    from oumi_megatron.engine.engine import MegatronEngine as MegatronEngine
    from oumi_megatron.engine.parallel.layout import ParallelLayout as ParallelLayout
    from oumi_megatron.engine.state.conversion import convert_hf_to_megatron as convert_hf_to_megatron
    from oumi_megatron.engine.state.conversion import export_to_hf as export_to_hf
    from oumi_megatron.model_shape import ModelShape as ModelShape
    from oumi_megatron.validation import ValidationReport as ValidationReport
    from oumi_megatron.validation import validate_config as validate_config

def __getattr__(name: str) -> Any:
    module_name = _LAZY_EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'oumi_megatron' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)
