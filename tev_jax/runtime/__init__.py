"""How the command lines run: which jax backends start, quietly (`platforms`), stopping
long work on a signal at a safe point (`signals`) and how a command ends (`exit_codes`).
Importing this package imports no jax."""
