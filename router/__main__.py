from __future__ import annotations

import sys

from router.server import main

sys.exit(main())
