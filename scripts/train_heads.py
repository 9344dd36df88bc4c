#!/usr/bin/env python
"""Train HiSpec exit heads: ``accelerate launch scripts/train_heads.py --recipe recipes/<model>.yaml``."""

import sys

from hispec_train.cli import main

if __name__ == "__main__":
    sys.exit(main())
