"""Megatron's checkpoints: Megatron-LM's read and written, Megatron-DeepSpeed's read, at any layout.

Modules:
  lm                  Megatron-LM's checkpoints opened: iteration directory, format, stored args, parts
  names               Megatron's file and tensor names -> hybrid's canonical names and back
  args                Megatron-LM's stored args -> ModelConfig; the args a conversion records
  legacy              the legacy `--ckpt-format torch` rank files, read
  torch_dist          megatron-core's torch_dist checkpoints, read (the model's tensors or the optimizer's)
  dcp_files           torch_dist's files a region at a time
  optimizer           Megatron's Adam state as hybrid can map it
  write               Megatron-LM checkpoints written (legacy and torch_dist)
  megatron_deepspeed  Megatron-DeepSpeed's checkpoints, read
  source              which Megatron checkpoint a path holds, and its reader
  universal           Megatron's Adam state as a DeepSpeed universal checkpoint
"""
