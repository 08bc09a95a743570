from capdispatch.dispatch.cli import main

raise SystemExit(main())
