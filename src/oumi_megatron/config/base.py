"""The base class of our config sections: Oumi's ``BaseParams`` where Oumi is installed.

The engine and the GRPO loop also run where Oumi is not installed (the lent GPU machine); there the
sections are plain dataclasses. Oumi only needs BaseParams for its recursive finalize_and_validate,
which does not run without Oumi.
"""

from __future__ import annotations

from dataclasses import dataclass

try:
    from oumi.core.configs.params.base_params import BaseParams
except ImportError:  # pragma: no cover - exercised on engine-only machines

    @dataclass
    class BaseParams:  # type: ignore[no-redef]
        def finalize_and_validate(self) -> None:
            pass


__all__ = ["BaseParams"]
