"""``python -m kvos.cli``: the kvos command."""

from kvos.cli import main

raise SystemExit(main())
