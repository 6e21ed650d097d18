"""A checkpoint from elsewhere is data, read safely.

torch's distributed-checkpoint reader (what Megatron-Core's ``dist_checkpointing.load`` runs) unpickles a checkpoint's
``.metadata`` with ``pickle.load`` and its byte items (``_extra_state``, optimizer parameter groups, the common state)
with ``torch.load(weights_only=False)``: a crafted file could name any callable and have it run at load time.
``install`` replaces both readers, once, before this package reads a checkpoint: the metadata through an unpickler that
admits only the classes torch writes there, the byte items through torch's weights-only unpickler. The narrowest
change that closes both: the two methods, in the one place every load passes (engine/state/checkpoint_io.py).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

METADATA_CLASSES: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "MetadataIndex",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch": frozenset({"Size"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "slice", "complex", "bytearray"}),
}
"""What a ``.metadata`` file may name (read off the checkpoints torch 2.11 writes), plus torch's dtypes."""


class CheckpointMetadataError(pickle.UnpicklingError):
    """A ``.metadata`` file names something a checkpoint's metadata does not hold."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in METADATA_CLASSES.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                         torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointMetadataError(f"a checkpoint's metadata names {module}.{name}, which checkpoint metadata does "
                                      "not hold: refused (the file is damaged or was crafted)")


def load_metadata(stream: Any) -> Any:
    """A ``.metadata`` file's object, read through ``_MetadataUnpickler``."""
    return _MetadataUnpickler(stream).load()


_installed = False


def install() -> None:
    """Route torch's checkpoint reads through the safe readers (idempotent)."""
    global _installed
    if _installed:
        return
    from torch.distributed.checkpoint import default_planner, filesystem

    def read_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(f)
        if getattr(metadata, "storage_meta", None) is None:  # as torch's own reader completes it
            metadata.storage_meta = filesystem.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def load_bytes(self: Any, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            default_planner.set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded

    filesystem.FileSystemReader.read_metadata = read_metadata  # type: ignore[method-assign]
    default_planner.DefaultLoadPlanner.load_bytes = load_bytes  # type: ignore[method-assign]
    _installed = True
