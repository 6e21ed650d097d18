"""Wires MEGATRON_GRPO into Oumi lazily, without editing Oumi's files.

Oumi 0.9 has no trainer plugin API: ``TrainerType`` is a closed Enum, YAML is merged strictly into
``TrainingConfig`` and ``oumi.train.train`` is an if/elif chain. A ``.pth`` file calls :func:`install`
at interpreter start; that only appends an import hook to ``sys.meta_path``. When (and only when)
one of the Oumi modules below is first imported, the matching patch in
``oumi_megatron.integration.oumi_patches`` runs right after the module body. Importing Oumi's modules
eagerly here would slow every Python start and break ``oumi train`` (the package-level ``oumi.train``
function is shadowed once the ``oumi.train`` module is imported), hence the hook.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

# Oumi module -> name of the patch function in oumi_megatron.integration.oumi_patches.
PATCHED_MODULES: dict[str, str] = {
    "oumi.core.configs.params.training_params": "patch_trainer_type",
    "oumi.core.configs.training_config": "patch_training_config",
    "oumi.train": "patch_train",
    "oumi.cli.distributed_run": "patch_distributed_torchrun",
}


def _apply_patch(module_name: str, module: types.ModuleType) -> None:
    # A broken patch must never break plain Oumi: warn and leave the module as Oumi wrote it.
    try:
        from oumi_megatron.integration import oumi_patches

        getattr(oumi_patches, PATCHED_MODULES[module_name])(module)
    except Exception as e:  # noqa: BLE001
        import warnings

        warnings.warn(
            f"oumi-megatron could not hook {module_name} ({type(e).__name__}: {e}); "
            "MEGATRON_GRPO is unavailable through the oumi CLI in this process.",
            stacklevel=2,
        )


class _PatchingLoader(importlib.abc.Loader):
    """Delegates to the real loader, then applies our patch to the fresh module."""

    def __init__(self, wrapped: importlib.abc.Loader, module_name: str) -> None:
        self._wrapped = wrapped
        self._module_name = module_name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._wrapped.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._wrapped.exec_module(module)
        _apply_patch(self._module_name, module)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, get_source, ...
        return getattr(self._wrapped, name)


class OumiPatchFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in PATCHED_MODULES:
            return None
        for finder in sys.meta_path:
            if isinstance(finder, OumiPatchFinder) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, fullname)
                return spec
        return None


def install() -> None:
    """Registers the import hook once; patches modules that are already imported. Idempotent."""
    if not any(isinstance(f, OumiPatchFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, OumiPatchFinder())
    for name in PATCHED_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            _apply_patch(name, module)
