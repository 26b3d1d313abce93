import sys

from decode_worker.worker import main

sys.exit(main())
