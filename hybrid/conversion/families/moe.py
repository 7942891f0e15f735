"""Mixture-of-experts layers as the Llama-family MoE checkpoints store them: a component (`ExpertLayout`) the
MoE families compose (where the router and experts sit, each expert's projection names, shared experts, sigmoid
routing), and the config mappings two families each share (Qwen2/3-MoE's, DeepSeek-V3's and GLM-4.5's)."""

from __future__ import annotations

import dataclasses

import torch

from hybrid.conversion.families.adapter import expect, get, gated_to_canonical, gated_to_hf, refuse
from hybrid.model.config import ModelConfig
from hybrid.model.naming import EXPERTS


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """Where an MoE layer's router (`gate.weight`) and every expert's gate/up/down projections sit in a family's
    checkpoint, with optional shared experts; dense layers are mapped as the dense family maps them."""

    block: str = "mlp"  # the HF module of a layer's router and experts
    expert_names: tuple = ("gate_proj", "up_proj", "down_proj")  # an expert's projections: gate, up, down
    shared: bool = False  # shared experts every token sees
    shared_block: str = "shared_expert"  # their HF module
    shared_gated: bool = True  # scaled by sigmoid(x w) (Qwen2-MoE's `shared_expert_gate`)
    sigmoid_routing: bool = False  # DeepSeek's router: sigmoid scores, a score bias, groups, a scaling factor
    score_bias: str = "gate.e_score_correction_bias"  # the sigmoid router's score bias, in `block`
    softmax_scaled: bool = False  # a softmax router whose weights are scaled (Mistral 4's routed_scaling_factor)
    fused: bool = False  # the experts stacked: experts.gate_up_proj [E, 2 f, h] ([gate; up]), experts.down_proj
    # [E, h, f] (transformers 5's DeepseekV3Experts layout, which Mistral 4's checkpoints keep)

    def wanted(self, c: ModelConfig, family_wanted: dict) -> dict:
        """What an export needs of the model's MoE options (flag -> whether it holds), the family's own added."""
        shared = bool(c.moe_shared_expert_intermediate_size)
        wanted = {"--num-experts": bool(c.num_experts),
                  ("--moe-shared-expert-intermediate-size" if self.shared else "no shared experts"):
                      shared == self.shared,
                  "--moe-shared-expert-gate" + ("" if self.shared_gated else " off"):
                      not shared or c.moe_shared_expert_gate == self.shared_gated, **family_wanted}
        if not self.sigmoid_routing:
            wanted.update({"--moe-router-score-function softmax": c.moe_router_score_function == "softmax",
                           "no --moe-router-topk-scaling-factor":
                               self.softmax_scaled or not c.moe_router_topk_scaling_factor,
                           "no --moe-router-enable-expert-bias": not c.moe_router_enable_expert_bias,
                           "no --moe-router-num-groups": not c.moe_router_num_groups})
        return wanted

    def to_canonical(self, c: ModelConfig, hf_state, i: int, out: dict, wanted=None) -> None:
        """MoE layer i's router, experts (an EP rank's own only, when `wanted` names them) and shared experts."""
        hf, ours = f"model.layers.{i}.{self.block}.", f"layers.{i}.mlp."
        out[ours + "router.weight"] = expect(hf + "gate.weight", get(hf_state, hf + "gate.weight"),
                                             (c.num_experts, c.hidden_size))
        if self.sigmoid_routing:
            name = hf + self.score_bias
            out[ours + "router.score_bias"] = expect(name, get(hf_state, name), (c.num_experts,))
        if self.fused:
            self.fused_to_canonical(c, hf_state, hf, ours, out, wanted)
        for e in range(0 if self.fused else c.num_experts):
            expert = f"{ours}{EXPERTS[1:]}{e}."
            if wanted is None or f"{expert}fc1.weight" in wanted:  # an EP rank reads its own experts only
                gated_to_canonical(hf_state, f"{hf}experts.{e}.", expert, out, self.expert_names)
        if self.shared:
            gated_to_canonical(hf_state, f"{hf}{self.shared_block}.", ours + "shared_mlp.", out)
            if self.shared_gated:
                out[ours + "shared_gate"] = get(hf_state, hf + "shared_expert_gate.weight")

    @staticmethod
    def fused_to_canonical(c: ModelConfig, hf_state, hf: str, ours: str, out: dict, wanted) -> None:
        """The stacked experts' fc1 = gate_up_proj[e] ([gate; up] already) and fc2 = down_proj[e]."""
        e, h, f = c.num_experts, c.hidden_size, c.moe_ffn_hidden_size
        gate_up = expect(hf + "experts.gate_up_proj", get(hf_state, hf + "experts.gate_up_proj"), (e, 2 * f, h))
        down = expect(hf + "experts.down_proj", get(hf_state, hf + "experts.down_proj"), (e, h, f))
        for j in range(e):
            expert = f"{ours}{EXPERTS[1:]}{j}."
            if wanted is None or f"{expert}fc1.weight" in wanted:
                out[expert + "fc1.weight"], out[expert + "fc2.weight"] = gate_up[j].clone(), down[j].clone()

    def to_hf(self, c: ModelConfig, state: dict, i: int, out: dict) -> None:
        hf, ours = f"model.layers.{i}.{self.block}.", f"layers.{i}.mlp."
        out[hf + "gate.weight"] = state[ours + "router.weight"]
        if self.sigmoid_routing:  # a router without a score bias routes as one of zeros
            out[hf + self.score_bias] = state.get(ours + "router.score_bias", torch.zeros(c.num_experts))
        if self.fused:
            experts = [f"{ours}{EXPERTS[1:]}{e}." for e in range(c.num_experts)]
            out[hf + "experts.gate_up_proj"] = torch.stack([state[x + "fc1.weight"] for x in experts])
            out[hf + "experts.down_proj"] = torch.stack([state[x + "fc2.weight"] for x in experts])
        for e in range(0 if self.fused else c.num_experts):
            gated_to_hf(state, f"{ours}{EXPERTS[1:]}{e}.", f"{hf}experts.{e}.", out, self.expert_names)
        if self.shared:
            gated_to_hf(state, ours + "shared_mlp.", f"{hf}{self.shared_block}.", out)
            if self.shared_gated:
                out[hf + "shared_expert_gate.weight"] = state[ours + "shared_gate"]


# DeepSeek-V3's mixture of experts (also GLM-4.5's): sigmoid scores, the score bias (`e_score_correction_bias`)
# choosing, group-limited top-k (`n_group`, `topk_group`: groups scored by their top 2), renormalised
# (`norm_topk_prob`) and scaled (`routed_scaling_factor`) weights, ungated shared experts (`n_shared_experts` x the
# expert width) and the first `first_k_dense_replace` layers dense.
DEEPSEEK_EXPERTS = ExpertLayout(shared=True, shared_block="shared_experts", shared_gated=False, sigmoid_routing=True)


def deepseek_moe_config(name: str, hf, config: ModelConfig) -> ModelConfig:
    """`config` with DeepSeek's MoE options from its HF config (`name`: the family, for messages)."""
    experts, k = int(hf.n_routed_experts), int(hf.num_experts_per_tok)
    if bool(hf.norm_topk_prob) != (k > 1):  # Megatron's sigmoid router renormalises top-k > 1 only
        refuse(name, "norm_topk_prob", hf.norm_topk_prob, f"with num_experts_per_tok {k}, the sigmoid router "
               f"renormalises the top-k weights exactly when k > 1 (as Megatron-LM's)")
    groups, chosen = int(hf.n_group or 1), int(hf.topk_group or 1)
    if chosen >= groups:  # every group is chosen: plain top-k
        groups = chosen = None
    elif k // chosen != 2:
        refuse(name, "topk_group", chosen, f"a group is scored by its top 2 experts there and by its top "
               f"num_experts_per_tok // topk_group = {k // chosen} in Megatron-LM's group-limited routing")
    dense = int(hf.first_k_dense_replace)
    shared = int(hf.n_shared_experts or 0) * int(hf.moe_intermediate_size)
    scale = float(hf.routed_scaling_factor)
    return dataclasses.replace(
        config, num_experts=experts, moe_router_topk=k, moe_ffn_hidden_size=int(hf.moe_intermediate_size),
        moe_layer_freq=1 if dense == 0 else [int(i >= dense) for i in range(hf.num_hidden_layers)],
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_dtype="fp32",  # (transformers' router: F.linear of fp32 casts)
        moe_router_topk_scaling_factor=None if scale == 1.0 else scale,
        moe_router_num_groups=groups, moe_router_group_topk=chosen, moe_shared_expert_intermediate_size=shared or None)


def first_dense(c: ModelConfig):
    """The number of dense layers before the MoE layers, or None when dense and MoE layers mix otherwise."""
    dense = next((i for i in range(c.num_layers) if c.mlp_type_of(i) == "moe"), c.num_layers)
    return dense if all(c.mlp_type_of(i) == "moe" for i in range(dense, c.num_layers)) else None


def deepseek_moe_wanted(c: ModelConfig) -> dict:
    """What an export to a DeepSeek-MoE family needs of the model's MoE options."""
    if not c.num_experts:
        return {}  # (--num-experts is wanted first)
    k, chosen = c.moe_router_topk, c.moe_router_group_topk
    return {"--moe-router-score-function sigmoid": c.moe_router_score_function == "sigmoid",
            "dense layers first, then MoE layers only (--moe-layer-freq)": first_dense(c) is not None,
            "--moe-shared-expert-intermediate-size a multiple of --moe-ffn-hidden-size":
                (c.moe_shared_expert_intermediate_size or 0) % c.moe_ffn_hidden_size == 0,
            "--moe-router-topk // --moe-router-group-topk = 2 (groups are scored by their top 2)":
                not chosen or chosen >= c.moe_router_num_groups or k // chosen == 2}


def deepseek_moe_fields(c: ModelConfig) -> dict:
    """DeepSeek's MoE fields of an HF config."""
    return dict(n_routed_experts=c.num_experts, num_experts_per_tok=c.moe_router_topk,
                moe_intermediate_size=c.moe_ffn_hidden_size,
                n_shared_experts=c.moe_shared_expert_intermediate_size // c.moe_ffn_hidden_size,
                routed_scaling_factor=c.moe_router_topk_scaling_factor or 1.0,
                n_group=c.moe_router_num_groups or 1, topk_group=c.moe_router_group_topk or 1,
                first_k_dense_replace=first_dense(c), norm_topk_prob=c.moe_router_topk > 1)


def qwen_moe_config(hf, config: ModelConfig, shared: bool) -> ModelConfig:
    """Qwen2-MoE / Qwen3-MoE: MoE where (layer + 1) % decoder_sparse_step == 0 and not in mlp_only_layers;
    norm_topk_prob renormalises the top-k softmax probabilities (without it: softmax, then top-k)."""
    experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts")
    step, dense = int(getattr(hf, "decoder_sparse_step", 1) or 1), set(getattr(hf, "mlp_only_layers", None) or [])
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(hf.num_hidden_layers)]
    fields = dict(num_experts=experts, moe_router_topk=hf.num_experts_per_tok,
                  moe_ffn_hidden_size=hf.moe_intermediate_size,
                  moe_layer_freq=1 if all(pattern) else pattern,
                  moe_router_pre_softmax=not getattr(hf, "norm_topk_prob", True))  # (Qwen3.5-MoE: always on)
    if shared:
        fields.update(moe_shared_expert_intermediate_size=hf.shared_expert_intermediate_size,
                      moe_shared_expert_gate=True)
    return dataclasses.replace(config, **fields)


def qwen_moe_fields(c: ModelConfig, shared: bool) -> dict:
    """Qwen2-MoE / Qwen3-MoE's fields of an HF config."""
    fields = dict(num_experts=c.num_experts, num_experts_per_tok=c.moe_router_topk,
                  moe_intermediate_size=c.moe_ffn_hidden_size, norm_topk_prob=not c.moe_router_pre_softmax,
                  decoder_sparse_step=1, mlp_only_layers=[i for i in range(c.num_layers) if c.mlp_type_of(i) != "moe"])
    if shared:
        fields["shared_expert_intermediate_size"] = c.moe_shared_expert_intermediate_size
    return fields
