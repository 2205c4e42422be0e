import sys

from radixserve.cli import main

sys.exit(main())
