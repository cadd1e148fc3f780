import sys

from pagellm.entrypoints.cli import main

sys.exit(main())
