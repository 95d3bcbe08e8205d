"""``python -m tev_jax.cli``: the ``tev-jax`` command."""

import sys

from tev_jax.cli import main

if __name__ == "__main__":
    sys.exit(main())
