from ephost.cli import main

raise SystemExit(main())
