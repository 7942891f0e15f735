"""hybrid: Megatron-style tensor, sequence and pipeline parallelism registered with DeepSpeed.

Modules (by floor, the ground first; tests/test_structure.py keeps the floors):
  errors           the one exception type for a user's mistake
  torch_fixes      torch defaults hybrid changes for the whole process
  safe_loading     every torch.load weights-only with an allow-list
  capabilities     what combines with what, declared once
  distributed      torch.distributed from the launcher's environment; the rank-aware log
  parallel         parallel sizes, the layout's groups, collectives, TP layers, the ring, FP8
  data             token files, tokenizers, GPT samples, chat data, prompts, the embedded corpus
  flags            Megatron-LM's command-line flags
  megatron_compat  Megatron flags with no feature behind them: accepted or refused by name
  pipeline_plan    pipeline schedules and virtual stages, planned from the flags
  run_length       iterations, samples or tokens; the learning rate's course
  model            the transformer, its layers, objectives and decoding
  checkpoint       the checkpoint format: files, manifest, client state, TP layout
  conversion       HuggingFace families, Megatron's checkpoints, layouts, universal checkpoints
  memory           the --dry-run memory estimator
  architecture     the model from the flags or a --load-hf config
  ds_config        the DeepSpeed JSON merged with the flags
  objective_flags  --sft, --dpo and --grpo's flags checked; --grpo's options
  config           flags -> RunConfig
  dry_run          --dry-run's report
  evaluation       launch/evaluate.py
  generation       launch/generate.py
  serving          launch/serve.py: an OpenAI-compatible endpoint on the engine's decoder
  training         the training run on a DeepSpeed engine
  cli              console entry points
"""

__version__ = "0.1.0"
