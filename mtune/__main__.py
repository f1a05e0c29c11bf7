"""``python -m mtune`` is the ``mtune`` command."""

import sys

from mtune._cli.main import main

sys.exit(main())
