import sys

from trtserve.cli import main

sys.exit(main())
