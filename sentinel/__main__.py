import sys

from sentinel.cli import main

sys.exit(main())
