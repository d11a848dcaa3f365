import sys

from potluck.cli import main

sys.exit(main())
