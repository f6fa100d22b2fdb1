import sys

from modal_rl.weightsync.cli import main

sys.exit(main())
