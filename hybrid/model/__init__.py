"""The decoder-only transformer: its config, its layers (attention, MLP or MoE, norms, embeddings, the LM
loss) and the forms the model runs in (GPTModel; DeepSpeed's pipeline stages through one adapter; the
virtual stages of the torch schedules), built for a rank by hybrid.model.build. Layers see plain tensors
and a ParallelGroups; nothing here knows the training loop."""
