"""``python -m fedopt_kernels`` runs the ``fedopt`` command line."""

from .cli import main

raise SystemExit(main())
