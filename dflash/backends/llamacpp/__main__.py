import sys

from dflash.backends.llamacpp.build import main

sys.exit(main())
