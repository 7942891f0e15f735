"""The decoder-only transformer: its config, its layers, the forms it runs in (the one model form and its virtual
stages, GPTModel its one-stage case), what it trains for, and decoding, built for a rank by hybrid.model.build.
Layers see plain tensors and a ParallelGroups; nothing here knows the training loop.

Modules:
  config          the shape and options, named as Megatron-LM's flags
  init            layout-independent weight initialisation
  naming          canonical parameter names, and those of older checkpoints
  qkv             the fused QKV layout
  rotary          rotary position embedding (rotate-half)
  norms           LayerNorm and RMSNorm exact under sequence parallelism, and Q/K norms across heads
  embedding       the input embedding and the output head
  per_layer       Gemma 4's per-layer inputs: the embedding side and each layer's gate
  sequence        each token's document and position
  flash           flash-attn where installed and usable
  sinks           attention sinks (GPT-OSS)
  attention       causal self-attention
  mla             multi-head latent attention (DeepSeek-V3)
  dsa             DeepSeek sparse attention: the lightning indexer and each query's top-k keys (DeepSeek-V3.2)
  gated_delta_net  Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next) and its PyTorch reference
  mlp             the feed-forward block and the builder that picks it
  lora            LoRA: which HF projection is which linear, the adapters attached, the base frozen
  moe             mixture of experts as megatron-core splits it
  transformer     one pre-norm transformer layer
  recompute       full activation recompute through deepspeed.checkpointing
  mtp             multi-token prediction
  virtual_stages  the one model form: a pipeline rank's parameters and virtual stages
  gpt             its one-stage case (PP = 1)
  build           this rank's model, for training and evaluation alike
  loss            the LM loss from TP-split logits
  preference      DPO's loss (TRL's)
  grpo            GRPO's mathematics (TRL's)
  objectives      what a run trains for, one object each
  forward_only    forward passes through a rank's stages (evaluation, scoring)
  kv_cache        the key/value (and latent) cache of decoding
  generate        generation with the model's own layers at its layout
"""
