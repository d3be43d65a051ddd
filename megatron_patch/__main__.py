import sys

from megatron_patch.cli import main

if __name__ == "__main__":
    sys.exit(main())
