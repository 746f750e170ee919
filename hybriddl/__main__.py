from hybriddl.cli import main

raise SystemExit(main())
