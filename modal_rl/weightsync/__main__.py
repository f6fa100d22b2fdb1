import sys

from modal_rl.weightsync.cli.commands import main

sys.exit(main())
