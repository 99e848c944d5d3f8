"""``python -m tailserve.cli``: the ``tailserve`` command."""

import sys

from tailserve.cli import main

sys.exit(main())
