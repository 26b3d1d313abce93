import sys

from prefill_worker.worker import main

sys.exit(main())
