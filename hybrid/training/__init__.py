"""Training on a DeepSpeed engine: the entry (run), the engine's wiring (engine, deepspeed_fixes), the
loop (loop, steps, pipelining, reduction), where a run starts and what it saves (resume, saving,
async_save), its health policy, the converters (MoE, FP8, profiling), the LR schedule, logging and metrics."""
