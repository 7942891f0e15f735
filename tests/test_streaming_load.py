"""--load-hf reads a HuggingFace model a part at a time (the embeddings, then one transformer layer after
another), in the file's dtype, only the parts this rank holds: loading adds about one layer to a rank's
memory, not the model; the weights it loads are those the whole-model reader gives."""

import ctypes
import gc
import json

import pytest
import torch

from checks import combinations


def _resident(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def _peak_added(load) -> int:
    """Bytes `load()` adds to this process's peak resident memory (VmHWM restarted from the current size)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) restarts from the current resident size
    before = _resident("VmRSS:")
    load()
    return _resident("VmHWM:") - before


def _in_fresh_process(fn, *args):
    """`fn(*args)` in a new interpreter: a peak measured in the test process would depend on what earlier
    tests left in its heap (seen: the same load measured 133 MB after the module's other tests, 120 MB alone)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result(timeout=300)


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


def _load_hf_measured(path: str) -> dict:
    """In a fresh process: the peak a part-by-part --load-hf of `path` adds, the sizes it is judged by, and the
    parameters that differ from the whole-model reader's."""
    from hybrid.conversion.hf import hf_parts, read_hf_config, read_hf_dir
    from hybrid.conversion.layout import load_parts
    from hybrid.model.gpt import GPTModel
    from hybrid.model.naming import canonical_parameters
    from hybrid.parallel.groups import ParallelGroups
    config = read_hf_config(path)
    model = GPTModel(config, ParallelGroups.single())
    names = set(canonical_parameters(model, config.num_layers))
    layer_bf16 = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.0.")) * 2
    added = _peak_added(lambda: load_parts(model, hf_parts(path, config, names), config, ParallelGroups.single()))
    want, _, _ = read_hf_dir(path)  # the weights are the whole-model reader's (fp32), exactly
    differ = [name for name, param in canonical_parameters(model, config.num_layers).items()
              if not torch.equal(param[: want[name].size(0)], want[name])]
    return dict(added=added, layer_bf16=layer_bf16, embedding_bf16=config.vocab_size * config.hidden_size * 2,
                differ=differ)


@pytest.mark.slow
def test_load_hf_adds_about_one_layer_to_the_peak_not_the_model(tmp_path):
    params = _llama(tmp_path / "hf")
    assert json.load(open(tmp_path / "hf" / "model.safetensors.index.json"))["weight_map"]
    got = _in_fresh_process(_load_hf_measured, str(tmp_path / "hf"))
    added, layer_bf16, embedding_bf16 = got["added"], got["layer_bf16"], got["embedding_bf16"]
    whole_fp32 = params * 4  # what reading the whole model in fp32 first would hold
    # the largest part is the embeddings and head (two [vocab, h] tables); a layer's read and fused copies
    assert added < 2 * embedding_bf16 + 3 * layer_bf16 + (32 << 20), (added, layer_bf16, embedding_bf16)
    assert added < 0.3 * whole_fp32, (added, whole_fp32)
    assert got["differ"] == []


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
    from checks.rank_pool import run_on_ranks
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


def _finetune_load_measured(path: str) -> dict:
    """In a fresh process: the peak a part-by-part weights-only load of the hybrid checkpoint `path` adds, the
    sizes it is judged by, and the parameters that differ from the whole-model reader's."""
    from hybrid.checkpoint.client_state import ClientState
    from hybrid.conversion.layout import hybrid_parts, load_parts, read_hybrid
    from hybrid.model.gpt import GPTModel
    from hybrid.model.naming import canonical_parameters
    from hybrid.parallel.groups import ParallelGroups
    config = ClientState.from_meta(read_hybrid(path)[1]).model_config()
    gc.collect()
    model = GPTModel(config, ParallelGroups.single())
    names = set(canonical_parameters(model, config.num_layers))
    layer_fp32 = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.0.")) * 4
    added = _peak_added(lambda: load_parts(model, hybrid_parts(path, None, config, names), config,
                                           ParallelGroups.single()))
    want, _ = read_hybrid(path)
    differ = [name for name, param in canonical_parameters(model, config.num_layers).items()
              if not torch.equal(param[: want[name].size(0)], want[name])]
    return dict(added=added, layer_fp32=layer_fp32, embedding_fp32=config.vocab_size * config.hidden_size * 4,
                differ=differ)


@pytest.mark.slow
def test_finetune_load_of_a_hybrid_checkpoint_adds_about_one_layer_to_the_peak_not_the_model(tmp_path):
    """--finetune (and any weights-only load) reads a hybrid checkpoint a part at a time, memory-mapped,
    in the file's dtype, at any storage; the weights are the whole-model reader's."""
    from hybrid.conversion.checkpoint_util import main as convert
    params = _llama(tmp_path / "hf", layers=16, hidden=576)  # 12 heads of 48
    assert convert(["--loader", "hf", "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "tp2"),
                    "--target-tensor-parallel-size", "2", "--no-progress-bar"]) == 0
    got = _in_fresh_process(_finetune_load_measured, str(tmp_path / "tp2"))
    added, layer_fp32, embedding_fp32 = got["added"], got["layer_fp32"], got["embedding_fp32"]
    whole_fp32 = params * 4  # the files are fp32 (conversion writes what it read, in fp32)
    # the largest part: the two [vocab, h] tables, their TP 2 shards joined; a layer's shards and join
    assert added < 2 * 2 * embedding_fp32 + 3 * layer_fp32 + (16 << 20), (added, layer_fp32, embedding_fp32)
    assert added < 0.4 * whole_fp32, (added, whole_fp32)
    assert got["differ"] == []


def _save_tiny(save, names, data):
    from hybrid.training.run import run_training
    argv = combinations._tiny(data, save) + combinations._flags(names)
    argv[argv.index("--train-iters") + 1] = "2"
    assert run_training(argv) == 0


@pytest.mark.slow
@pytest.mark.parametrize("names", [("tp2",), ("tp2_sp", "pp2"), ("pp2_interleaved",), ("ep2",), ("ep2", "pp2")],
                         ids=["plain_tp2", "layer_files_tp2_pp2", "virtual_stages", "experts", "experts_pp2"])
def test_parts_of_every_checkpoint_storage_are_the_whole_readers_tensors(names, tmp_path):
    """hybrid_parts, at each way DeepSpeed and the torch schedules store weights (module files, layer
    files, virtual stages, MoE expert files), gives every tensor of read_hybrid exactly, each in one
    part, the embeddings first and then each layer's in order; asked for a subset it reads only that."""
    from checks.launch_helpers import copy_default_corpus
    from checks.rank_pool import run_on_ranks
    from hybrid.checkpoint.client_state import ClientState
    from hybrid.conversion.layout import hybrid_parts, read_hybrid
    data = copy_default_corpus(str(tmp_path))
    save = str(tmp_path / "ckpt")
    run_on_ranks(_save_tiny, combinations._world(names), save, names, data)
    want, meta = read_hybrid(save)
    config = ClientState.from_meta(meta).model_config()
    parts = list(hybrid_parts(save, None, config, set(want)))
    got = {}
    for part in parts:
        assert not set(part) & set(got), "a tensor in two parts"
        got.update(part)
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == torch.float32 and torch.equal(got[name], want[name]), name
    layers = [sorted({int(n.split(".")[1]) for n in p if n.startswith("layers.")}) for p in parts]
    assert layers == [[]] + [[i] for i in range(config.num_layers)]
    one = {n for n in want if n.startswith("layers.1.")}
    assert [set(p) for p in hybrid_parts(save, None, config, one)] == [one]
