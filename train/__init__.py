"""Drafter training: target rollouts, anchors, the ExitTrain optax step, the loop, the CLI.

``python -m train rollouts ...`` writes target rollouts; ``python -m train run ...``
trains a DFlash drafter on them (`train.loop.train` over a `train.config.TrainConfig`).
The objectives themselves live in `tev_jax.exit_train`. The bundled demo models are
built by `train.demo`, apart.
"""
