"""Training on a DeepSpeed engine, from where the run starts to what it leaves.

Modules:
  start            where the run starts, decided once before its config (StartPlan)
  run              launch/train.py's entry
  engine           model, optimizer and schedule handed to deepspeed.initialize
  deepspeed_fixes  the only places hybrid touches DeepSpeed internals
  deepspeed_internals  the internals those fixes rely on, by name (checked by tests/test_deepspeed_fixes.py)
  resume           the start's four loaders and their one epilogue
  loop             the training loop
  runtime          the one runtime of every layout and schedule
  pipeline_stages  PP > 1: a rank's virtual stages as torch.distributed.pipelining stages
  reduction        losses combined over micro-batches and data-parallel ranks
  rollout          --grpo's rollouts on the engine's own model
  environments     --grpo-environment: multi-turn episodes (Gym's reset / step)
  reference_logps  DPO's reference log-probabilities, computed once
  muon             --optimizer muon
  lr_schedules     Megatron-LM's learning-rate schedule
  features         MoE, FP8 and profiling: their moments in a run, as one list
  moe_hooks        what each iteration does for the MoE layers (and DSA indexers trained by their loss)
  health           the NaN and loss-scale stops
  saving           checkpoints written during a run
  async_save       --async-save
  metrics          one logged iteration's record, the MFU
  flops            model FLOPs per iteration (Megatron-LM's formula)
  profiling        torch.profiler traces, memory snapshots, peak memory
  logging          rank-aware log lines, JSON, TensorBoard, wandb, progress
  plots            pictures a run leaves (the GRPO reward)
  demo             the export and sample a run ends with
"""
