from memfit.cli.main import main

raise SystemExit(main())
