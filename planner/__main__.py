import sys

from planner.service import main

sys.exit(main())
