"""``python -m kvos``: the ``kvos`` command line."""

from kvos.cli import main

raise SystemExit(main())
