from leantune.cli.app import main

raise SystemExit(main())
