"""The base class of errors caused by the user's input (config, data, output folder, checkpoint).

Such errors carry a message that names the field, file or row and says how to fix it. They derive
from Oumi's ``OumiConfigError`` where Oumi is installed, so ``oumi train`` prints the message (no
traceback) and exits 1, as it does for its own config errors.
"""

from __future__ import annotations

try:
    from oumi.exceptions import OumiConfigError as _Base
except ImportError:  # pragma: no cover - engine-only machines (the lent GPU image has no Oumi)
    _Base = ValueError


class UserInputError(_Base):
    """Bad input, reported with the field/file/row and the fix."""
