"""Megatron-format token files, tokenizers, GPT samples, chat data, prompts, and the embedded default corpus.

Modules:
  indexed      Megatron's memory-mapped .bin/.idx, read and written
  preprocess   JSON lines -> .bin/.idx (launch/preprocess_data.py)
  tokenizer    tokenizers named as Megatron-LM's --tokenizer-type; the ids that end a completion
  gpt_dataset  GPT samples with megatron-core's indices, splits and blending
  batches      a run's datasets, the sampler, the one batch encoding
  plan         the data plan a checkpoint records, and what a resume changes of it
  default      the embedded corpus and tokenizer
  chat         chat data for --sft and --dpo
  prompts      prompts for generation and --grpo
  arithmetic   the embedded --grpo task
  gym_tasks    reasoning_gym's tasks as --grpo's prompts and reward
"""
