import sys

from megascope.cli import main

sys.exit(main())
