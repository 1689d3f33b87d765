"""``python -m graphrt.cli``: the ``graphrt`` command."""

from graphrt.cli import main

raise SystemExit(main())
