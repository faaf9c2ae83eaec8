"""``python -m pagedserve.entrypoints.cli``: the `pagedserve` command."""

import sys

from pagedserve.entrypoints.cli.main import main

sys.exit(main())
