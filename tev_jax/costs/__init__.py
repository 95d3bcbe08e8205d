"""What programs cost, and the choices made from it: memory plans for TPU slices and GPUs
(`plan`), a compiled program's report and per-op table (`program_report`, `op_costs`),
GPU kernel launches and time (`launches`, `gpu_time`), the chips themselves (`chips`),
the seconds of a decode round (`round_costs`, `timing`) and the tree budget chosen from
them with the exit law (`tune`)."""
