import sys

from rapidlite.cli import main

sys.exit(main())
