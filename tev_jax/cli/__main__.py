"""``python -m tev_jax.cli``: the ``tev-jax`` command."""

from tev_jax.cli import run

if __name__ == "__main__":
    run()
