from leantune.cli import main

raise SystemExit(main())
