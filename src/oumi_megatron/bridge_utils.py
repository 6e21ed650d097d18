"""Importing Megatron-Bridge, and the design document's ``check_megatron_bridge_available()``.

megatron-bridge 0.6.2 imports ``transformer_engine.pytorch`` unconditionally (``peft/lora_layers.py``),
even though nothing we use needs it, and TransformerEngine cannot be installed without CUDA. When TE
is absent we import the bridge with a throw-away stand-in module for TE that only megatron.bridge
modules can see (Megatron-Core modules imported meanwhile run with it hidden), then remove it and
switch the bridge's ``HAVE_TE*`` flags back to False, so no code path believes TE exists. This is the
only TE workaround in the project; with TE installed it does nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
import types
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from oumi_megatron.config.problems import Findings
    from oumi_megatron.model_shape import ModelShape


INSTALL_HINT = (
    "megatron-bridge is not available. Install it with\n"
    "  pip install megatron-bridge megatron-core megatron-lm\n"
    "or from source:\n"
    "  pip install git+https://github.com/NVIDIA-NeMo/Megatron-Bridge.git\n"
    "(In this repository, `bash scripts/setup.sh` installs the pinned, tested set.)"
)


class _Placeholder:
    """Stands for any TE class: isinstance() against it is always False."""


class _TEStandIn(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            placeholder = type(name, (_Placeholder,), {})
            setattr(self, name, placeholder)
            return placeholder
        child = _TEStandIn(f"{self.__name__}.{name}")
        setattr(self, name, child)
        return child


def have_transformer_engine() -> bool:
    """Whether TransformerEngine is installed (the one probe: model specs, schedules and this module ask it)."""
    return importlib.util.find_spec("transformer_engine") is not None


_TE_NAMES = ("transformer_engine", "transformer_engine.pytorch")


def _te_flags_off(module: types.ModuleType) -> None:
    for key, value in list(vars(module).items()):
        if key.startswith("HAVE_TE") and value is True:
            setattr(module, key, False)


class _HideStandInLoader(importlib.abc.Loader):
    """Runs a Megatron-Core module with the TE stand-in hidden, so it records HAVE_TE=False and
    takes no TE code path at import time (e.g. layer specs built at module level)."""

    def __init__(self, wrapped: importlib.abc.Loader) -> None:
        self._wrapped = wrapped

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._wrapped.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        hidden = {name: sys.modules.pop(name) for name in _TE_NAMES if name in sys.modules}
        try:
            self._wrapped.exec_module(module)
        finally:
            sys.modules.update(hidden)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)


class _MegatronCoreFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not fullname.startswith("megatron.core."):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _HideStandInLoader(spec.loader)
                return spec
        return None


@contextlib.contextmanager
def _quiet_imports() -> Iterator[None]:
    """Without TE/apex, Megatron's imports emit dozens of "falling back" warnings and tracebacks
    logged at INFO; they say nothing a user can act on, so keep them off the console."""
    previous = logging.root.manager.disable
    logging.disable(logging.INFO)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def import_megatron_core() -> types.ModuleType:
    """``import megatron.core`` (and its optimizer/specs modules) without the fallback noise."""
    with _quiet_imports():
        import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
        import megatron.core.optimizer  # noqa: F401

        return importlib.import_module("megatron.core")


def import_megatron_bridge() -> types.ModuleType:
    """``import megatron.bridge``, working around its unconditional TransformerEngine import.

    The first import runs on a thread of its own. Bridge imports nvidia-modelopt, which imports pulp, and pulp keeps
    the exception of each optional solver that failed to import (``pulp.apis.core._OPTIONAL_IMPORT_ERRORS``) with its
    traceback: every frame of the importing stack lives as long as the process, and with them the locals of our
    callers. Imported from the conversion, that pinned the converted model (a whole bf16 model of GPU memory per rank,
    measured on the 70B-wide slice); a thread's stack holds nothing of ours."""
    if "megatron.bridge" in sys.modules:
        return _import_megatron_bridge()
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["module"] = _import_megatron_bridge()
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            result["error"] = e

    thread = threading.Thread(target=run, name="import-megatron-bridge")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["module"]


def _import_megatron_bridge() -> types.ModuleType:
    if "megatron.bridge" in sys.modules or have_transformer_engine():
        with _quiet_imports():
            return importlib.import_module("megatron.bridge")
    import_megatron_core()
    before = set(sys.modules)
    stand_ins = {name: _TEStandIn(name) for name in _TE_NAMES}
    stand_ins["transformer_engine"].pytorch = stand_ins["transformer_engine.pytorch"]  # type: ignore[attr-defined]
    finder = _MegatronCoreFinder()
    sys.meta_path.insert(0, finder)
    sys.modules.update(stand_ins)
    try:
        with _quiet_imports():
            bridge = importlib.import_module("megatron.bridge")
    finally:
        sys.meta_path.remove(finder)
        for name in _TE_NAMES:
            sys.modules.pop(name, None)
    # Bridge modules that saw the stand-in believe TE exists; tell them it does not.
    for name in set(sys.modules) - before:
        module = sys.modules.get(name)
        if module is not None and name.startswith("megatron.bridge"):
            _te_flags_off(module)
    return bridge


def check_megatron_bridge_available() -> None:
    """Raises ``ImportError`` with install instructions unless Megatron-Bridge and Megatron-Core import."""
    for module in ("megatron.core", "megatron.bridge"):
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            raise ImportError(INSTALL_HINT)
    try:
        bridge = import_megatron_bridge()
        bridge.AutoBridge  # noqa: B018 - the entry point we use; fails if the install is broken
    except Exception as e:  # noqa: BLE001
        raise ImportError(f"{INSTALL_HINT}\n(import failed: {type(e).__name__}: {e})") from e


def check_megatron_bridge(shape: ModelShape | None, found: Findings) -> None:
    """Megatron-Bridge imports, and converts the model's architecture (where the shape was read)."""
    try:
        check_megatron_bridge_available()
    except ImportError as e:
        found.add("megatron-bridge", str(e))
        return
    if shape is not None and shape.architectures:
        supported = set(import_megatron_bridge().AutoBridge.list_supported_models())
        if not any(arch in supported for arch in shape.architectures):
            examples = sorted(a for a in supported if a.endswith("ForCausalLM"))[:8]
            found.add("model.model_name", f"{shape.source} is a {', '.join(shape.architectures)} model, which "
                                          f"Megatron-Bridge cannot convert. Use a supported architecture, e.g. "
                                          f"{', '.join(examples)} ...")
