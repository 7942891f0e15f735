"""Megatron's checkpoints: Megatron-LM's read (`lm`: legacy and torch_dist, `dcp_files`: torch_dist a region at a
time) and written (`write`), Megatron-DeepSpeed's read (`megatron_deepspeed`), which of them a path holds
(`source`), and Megatron's Adam state as a DeepSpeed universal checkpoint (`universal`)."""
