"""Batch generation: the prompts-file job behind ``tev-jax generate --prompts`` (`job`),
its resumable, sharded output files (`outputs`), continuous batching over a list of
prompts (`continuous`) and the progress bar's rates (`rates`)."""
