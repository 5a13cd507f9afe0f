import sys

from dflash.cli.commands import main

sys.exit(main())
