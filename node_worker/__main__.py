from .proc import main

raise SystemExit(main())
