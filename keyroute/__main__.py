from keyroute.cli import main

raise SystemExit(main())
