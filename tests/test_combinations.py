"""A fixed sample of the combination sweep (checks/combinations.py; the whole sweep writes its matrix to
checks/results/combinations.md): each combination is refused by a rule of the capability table before
any rank starts, or trains 4 iterations equal to one rank and resumes bitwise (with dropout: resumes bitwise)."""

import pytest

from checks import combinations

SAMPLE = {  # combination -> the outcome it must have (a rule's name for a refusal)
    "tp2_sp+pp2_interleaved": "equal",
    "ep2+cp2": "equal",
    "ulysses2+qwen3": "equal",
    "moe+documents": "deterministic",  # (one rank with its own flags: determinism and the resume)
    "dp2+zero3": "equal",
    "pp2_zbv+recompute_selective": "equal",  # the input step runs the whole backward (recompute inside it)
    "cp2+window": "equal",  # the ring masks its blocks to the window (was refused)
    "dp2+pp2_dualpipev": "dualpipev-micro-batches",
    "bf16+tp2": "equal",
    "dropout+cp2": "resumed",  # with dropout: the resume only (each CP rank draws its own masks)
    # the layouts whose launched proofs were cut from the suite for its time, back here with their resume
    "dropout+tp2_sp": "resumed",  # with dropout: the resume is bitwise (each TP rank's streams restored)
    "dropout+pp2": "resumed",
    "dropout+dp2+zero3_offload": "resumed",
    "cp2+pp2_interleaved": "equal",
    "ep2+zero1": "equal",
    "ep2+pp2": "equal",
    "ep2+recompute_full": "equal",
    "ep2+recompute_selective": "equal",
    # found by the sweep: DeepSpeed's bf16 optimizer on its pipeline engine (no ZeRO) did not load its own
    # checkpoint; CPU Adam (offload) resumed one float ulp away (hybrid.training.deepspeed_fixes.load_checkpoint)
    "pp2+bf16": "equal",
    "offload+bf16": "deterministic",
    "cp2+ulysses2": "cp-ulysses",
    # FP8 (torchao's casts, every amax over the whole tensor): the layouts equal one rank's FP8 run; delayed
    # scaling's amax history (once per iteration, over every micro-batch and DP rank) resumes bitwise
    "fp8+tp2_sp": "equal",
    "fp8+pp2": "equal",
    "fp8+cp2": "equal",
    "fp8+ep2": "equal",
    "fp8_delayed+dp2": "equal",
    "fp8_delayed+tp2_sp": "equal",
    # the one runtime: every schedule at PP 2 x DP 2 under ZeRO-2, ZeRO-3 and ZeRO-3 + offload (and ZeRO-1 offload),
    # TP 2 x PP 2 under ZeRO-3 at DP 1 and at DP 2 (8 ranks: ZeRO-3 shards over DP there)
    **{"+".join(cell): "equal" for cell in combinations.TRIPLES if "dp2" in cell and cell[1] in combinations.PIPELINES
       and (cell[-1] != "offload" or cell[1] == "pp2")},  # (ZeRO-1 offload: 1F1B here, every schedule in the sweep)
    "dp2+pp2_zbv+dsa_shared": "dsa-share-stages",  # (ZeroBubbleV's one layer per stage splits GLM-5's sharing)
    "tp2_sp+pp2+zero3": "equal",
    "tp2_sp+pp2+dp2+zero3": "equal",
    # untied (llama): ZeRO-3 holds each vocabulary table as row blocks (ModelConfig.zero3_vocab_block_rows), looked up
    # and multiplied block by block, over DP, PP and TP with SP
    "dp2+zero3+llama": "equal",
    "llama+dp2+pp2+zero3": "equal",
    "llama+tp2_sp+pp2+zero3": "equal",
    # Muon: each matrix orthogonalized whole on an owner rank of ZeRO's partitions, with TP and PP
    "tp2_sp+zero3+muon": "equal",
    "dp2+pp2+muon": "equal",
    "ep2+zero1+muon": "equal",
    "bf16+muon": "muon-precision",
    # Gated DeltaNet (Qwen3.5's layers): packed documents under CP (the heads' all-to-all), its experts over EP with
    # TP + SP; FP8 / Muon / LoRA refused by the table
    "cp2+documents+gdn": "equal",
    "ep2+tp2_sp+gdn": "equal",
    "gdn+lora": "gdn-fp8-muon-lora",
    # DeepSeek-V3's MLA (values of their own head size) over the layouts, and its multi-token prediction over PP
    "mla+tp2_sp": "equal",
    "mla+cp2": "equal",
    "mla+ulysses2": "equal",
    "mla+mtp+pp2": "equal",
    "mla+mtp+ep2+tp2_sp": "equal",
    "mla+mtp+pp2_zbv": "mtp-split-backward",
    # found by the sweep: MLA under --torch-compile (TorchInductor's attention pattern check on values of their own
    # head size) and MLA with a window (refused for no reason)
    "compile+mla": "equal",
    "mla+window": "deterministic",
    # found by the sweep: LoRA's frozen tied table at a pipeline's last stage (no gradient to exchange), and full
    # recompute over a frozen embedding (the checkpointed layers' input made to require a gradient)
    "pp2+lora": "equal",
    "recompute_full+lora": "equal",
    "tp2_sp+pp2+lora_all": "equal",
    "ep2+zero1+lora": "lora-moe-zero",
    "tp2_sp+pp2+dsa": "equal",
    "cp2+dsa": "dsa-sequence-split",
    "tp2_sp+pp2+heads_norm": "equal",
    "cp2+llama+query_temperature": "equal",
    # Gemma 4: its E2B/E4B form's per-layer inputs and KV sharing under TP + SP (a pipeline refused), its MoE block
    # at EP 2 x TP 2 + SP; DSA's indexer trained by its KL loss at TP 2 + SP (its projections' gradients summed)
    "tp2_sp+dp2+gemma4_e": "equal",
    "pp2+gemma4_e": "per-layer-inputs-pipeline",
    "ep2+tp2_sp+gemma4_moe": "equal",
    "tp2_sp+dsa_loss": "equal",
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from checks.launch_helpers import copy_default_corpus
    work = tmp_path_factory.mktemp("combinations")
    return str(work), copy_default_corpus(str(work))


@pytest.mark.slow
@pytest.mark.parametrize("combination", list(SAMPLE))
def test_a_combination_is_refused_by_the_table_or_equals_one_rank_and_resumes(combination, corpus):
    work, data = corpus
    result = combinations.evaluate_combination(tuple(combination.split("+")), data, work, _BASELINES)
    want = SAMPLE[combination]
    assert result["reference"], result  # every cell names what it was compared with
    if want in combinations.PASSED:
        assert result["status"] == want, result
    else:
        assert result["status"] == "refused" and result["rule"] == want, result


_BASELINES: dict = {}  # one-rank losses by model, shared by the sample
