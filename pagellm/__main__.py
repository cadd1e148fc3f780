import sys

from pagellm.cli import main

sys.exit(main())
