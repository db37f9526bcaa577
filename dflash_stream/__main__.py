from dflash_stream.cli import main

raise SystemExit(main())
