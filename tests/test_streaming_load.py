"""--load-hf reads a HuggingFace model a part at a time (the embeddings, then one transformer layer after
another), in the file's dtype, only the parts this rank holds: loading adds about one layer to a rank's
memory, not the model; the weights it loads are those the whole-model reader gives."""

import ctypes
import gc
import json

import pytest
import torch


def _resident(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def _llama(path, layers=8, hidden=768, vocab=8192, **fields):
    import transformers
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2048,
                                      num_hidden_layers=layers, num_attention_heads=12, num_key_value_heads=4,
                                      max_position_embeddings=64, tie_word_embeddings=False, dtype="bfloat16",
                                      **fields)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="40MB")  # several safetensors files and their index
    return sum(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_load_hf_adds_about_one_layer_to_the_peak_not_the_model(tmp_path):
    from hybrid.conversion.hf import hf_parts, read_hf_config
    from hybrid.conversion.layout import load_parts
    from hybrid.model.gpt import GPTModel
    from hybrid.model.naming import canonical_parameters
    from hybrid.parallel.groups import ParallelGroups
    params = _llama(tmp_path / "hf")
    assert json.load(open(tmp_path / "hf" / "model.safetensors.index.json"))["weight_map"]
    config = read_hf_config(str(tmp_path / "hf"))
    model = GPTModel(config, ParallelGroups.single())
    names = set(canonical_parameters(model, config.num_layers))
    layer_bf16 = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.0.")) * 2
    embedding_bf16 = config.vocab_size * config.hidden_size * 2
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) restarts from the current resident size
    before = _resident("VmRSS:")
    load_parts(model, hf_parts(str(tmp_path / "hf"), config, names), config, ParallelGroups.single())
    added = _resident("VmHWM:") - before
    whole_fp32 = params * 4  # what reading the whole model in fp32 first would hold
    # the largest part is the embeddings and head (two [vocab, h] tables); a layer's read and fused copies
    assert added < 2 * embedding_bf16 + 3 * layer_bf16 + (32 << 20), (added, layer_bf16, embedding_bf16)
    assert added < 0.3 * whole_fp32, (added, whole_fp32)
    # the weights are the whole-model reader's (fp32), exactly
    from hybrid.conversion.hf import read_hf_dir
    want, _, _ = read_hf_dir(str(tmp_path / "hf"))
    for name, param in canonical_parameters(model, config.num_layers).items():
        torch.testing.assert_close(param[: want[name].size(0)], want[name], rtol=0, atol=0, msg=name)


def _stage_and_expert_reads(path, pp, ep):
    """Which HF tensors a rank of PP x EP reads: its stage's layers, its own experts."""
    from hybrid.conversion import hf as hf_module
    from hybrid.conversion.hf import hf_parts, read_hf_config
    from hybrid.conversion.layout import load_parts
    from hybrid.model.build import build_model
    from hybrid.model.naming import canonical_parameters
    from hybrid.parallel.groups import build_groups
    from hybrid.pipeline_plan import PipelineSchedule
    config = read_hf_config(path)
    groups = build_groups(pipeline_parallel=pp, expert_parallel=ep, experts=True)
    model = build_model(config, groups, PipelineSchedule(partition="uniform"))
    read = []
    original = hf_module.HFTensors.__getitem__
    hf_module.HFTensors.__getitem__ = lambda self, name: read.append(name) or original(self, name)
    try:
        load_parts(model, hf_parts(path, config, set(canonical_parameters(model, config.num_layers))), config, groups)
    finally:
        hf_module.HFTensors.__getitem__ = original
    return {"pp_rank": groups.pp.rank, "ep_rank": groups.ep.rank, "read": read}


@pytest.mark.parametrize("pp, ep", [(2, 1), (1, 2)], ids=["pp2", "ep2"])
def test_each_rank_reads_only_its_stage_and_its_experts(pp, ep, tmp_path):
    from tests.hf_families import make_family
    from tests.rank_pool import run_on_ranks
    make_family("mixtral", tmp_path / "hf", tokenizer=False)
    results = run_on_ranks(_stage_and_expert_reads, 2, str(tmp_path / "hf"), pp, ep)
    for r in results:
        layers = {int(n.split(".")[2]) for n in r["read"] if n.startswith("model.layers.")}
        experts = {int(n.split(".experts.")[1].split(".")[0]) for n in r["read"] if ".experts." in n}
        if pp > 1:  # 4 layers over 2 stages; the embedding on the first, the norm and head on the last
            assert layers == ({0, 1} if r["pp_rank"] == 0 else {2, 3})
            assert ("model.embed_tokens.weight" in r["read"]) == (r["pp_rank"] == 0)
            assert ("lm_head.weight" in r["read"]) == (r["pp_rank"] == 1)
        else:  # 4 experts over 2 EP ranks
            assert experts == ({0, 1} if r["ep_rank"] == 0 else {2, 3})
        assert len(r["read"]) == len(set(r["read"])), "a tensor was read twice"
