"""`python -m ephost`: the command line (app/cli/). The layers contract (pyproject.toml) puts this entry point
above app/, the one module of ephost/ that does not belong to its shared core."""
from ephost.cli import main

raise SystemExit(main())
