"""Mixture of experts: a router picks k of E expert MLPs for each token; the tokens travel to the ranks
holding their experts (expert parallelism: an all-to-all inside the EP group) and their weighted
outputs come back; optional shared experts see every token.

Semantics are Megatron-LM's (megatron/core/transformer/moe: router.py, moe_utils.py), flag for flag:
softmax (top-k of the logits then softmax, or softmax then top-k with --moe-router-pre-softmax) or
sigmoid scores (normalised over the top k) with an optional score bias updated after each step
(DeepSeek-V3's auxiliary-loss-free balancing); the load-balancing loss per micro-batch (`aux_loss`) or
per sequence (`seq_aux_loss`) and the z-loss reach the router's gradient through
`AuxLossBackward` (no change to the loss the schedules see, so every pipeline schedule carries them);
dropless routing, or a capacity per expert with the lowest-probability (or latest) tokens dropped.

Layout: global expert e lives on EP rank e // (E / EP) as its local expert e % (E / EP). Under TP,
which needs --sequence-parallel (as in Megatron-LM), each TP rank routes its own sequence shard and
holds its EP rank's experts whole: experts are replicated over TP, not split, and their gradients
and the router's are summed over TP as the norms' are under SP. Shared experts are a dense MLP, TP
split like any other.

Names follow DeepSpeed's MoE convention (`deepspeed_moe.experts.deepspeed_experts.{local}`, expert
parameters marked `allreduce = False` with `group_name = "ep_size_{EP}"`): DeepSpeed's engine reduces
those over the expert-data-parallel group, gives them their own optimizer groups and writes each
expert to its own checkpoint file (the training package registers the layers with DeepSpeed).

The package follows megatron-core's `transformer/moe/`: `router` (scores, top-k, balancing losses,
capacity), `token_dispatcher` (tokens sorted by expert and sent to their EP ranks, outputs combined),
`experts` (the local experts' GEMMs), `moe_layer` (the block that joins them with shared experts).
What each training step does for these layers (the score-bias update, the logged losses) belongs to
the training package (its MoE step hooks).

Modules:
  router            the router: scores, top-k, balancing losses
  token_dispatcher  the tokens' trip to their experts' ranks and back
  experts           the experts' MLPs (a grouped GEMM or a loop)
  moe_layer         the MoE block: router, dispatcher, experts, shared experts
"""
