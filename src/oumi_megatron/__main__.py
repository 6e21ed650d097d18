"""``python -m oumi_megatron`` == ``oumi-megatron``."""

import sys

from oumi_megatron.cli import main

sys.exit(main())
