"""TP/SP layers, cross-entropy and RNG equal the unsharded torch reference (fp32, <= 1e-5)."""

import pytest
import torch
import torch.nn.functional as F

from checks.rank_pool import assert_close, run_on_ranks

ATOL = 1e-5
S, B, H, OUT, VOCAB = 8, 2, 16, 24, 64


def _setup(tp):
    from hybrid.parallel.groups import build_groups
    return build_groups(tensor_parallel=tp)


def _inputs(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _check_column(tp, sequence_parallel, gather_output):
    from hybrid.parallel.layers import ColumnParallelLinear, default_init
    topo = _setup(tp)
    rank = topo.tp.rank
    layer = ColumnParallelLinear(H, OUT, topo, default_init(seed=1), bias=True,
                                 gather_output=gather_output, sequence_parallel=sequence_parallel)
    with torch.no_grad():
        layer.bias.copy_(layer.bias + 0.1 * (rank + 1))  # non-zero bias, known per shard
    full_w = torch.empty(OUT, H)
    default_init(seed=1)(full_w)
    full_b = torch.cat([torch.zeros(OUT // tp) + 0.1 * (r + 1) for r in range(tp)])

    x = _inputs(S, B, H, seed=2).requires_grad_()
    ref = F.linear(x, full_w.requires_grad_(), full_b.requires_grad_())
    grad_out = _inputs(S, B, OUT, seed=3)
    ref.backward(grad_out)

    x_local = x.detach().chunk(tp, 0)[rank] if sequence_parallel else x.detach()
    x_local = x_local.clone().requires_grad_()
    out = layer(x_local)
    cols = slice(rank * OUT // tp, (rank + 1) * OUT // tp)
    expected_out = ref if gather_output else ref[..., cols]
    assert_close(out, expected_out, ATOL, "column output")
    out.backward(grad_out if gather_output else grad_out[..., cols])
    expected_dx = x.grad.chunk(tp, 0)[rank] if sequence_parallel else x.grad
    assert_close(x_local.grad, expected_dx, ATOL, "column input grad")
    assert_close(layer.weight.grad, full_w.grad[cols], ATOL, "column weight grad")
    assert_close(layer.bias.grad, full_b.grad[cols], ATOL, "column bias grad")
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0


def _check_row(tp, sequence_parallel, input_is_parallel):
    from hybrid.parallel.layers import RowParallelLinear, default_init
    topo = _setup(tp)
    rank = topo.tp.rank
    layer = RowParallelLinear(H, OUT, topo, default_init(seed=4), bias=True,
                              input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel)
    with torch.no_grad():
        layer.bias.fill_(0.3)
    full_w = torch.empty(OUT, H)
    default_init(seed=4)(full_w)
    full_b = torch.full((OUT,), 0.3)

    x = _inputs(S, B, H, seed=5).requires_grad_()
    ref = F.linear(x, full_w.requires_grad_(), full_b.requires_grad_())
    grad_out = _inputs(S, B, OUT, seed=6)
    ref.backward(grad_out)

    cols = slice(rank * H // tp, (rank + 1) * H // tp)
    x_local = (x.detach()[..., cols] if input_is_parallel else x.detach()).clone().requires_grad_()
    out = layer(x_local)
    if sequence_parallel:
        assert_close(out, ref.chunk(tp, 0)[rank], ATOL, "row output (SP)")
        out.backward(grad_out.chunk(tp, 0)[rank])
    else:
        assert_close(out, ref, ATOL, "row output")
        out.backward(grad_out)
    assert_close(x_local.grad, x.grad[..., cols] if input_is_parallel else x.grad, ATOL, "row input grad")
    assert_close(layer.weight.grad, full_w.grad[:, cols], ATOL, "row weight grad")
    # Under SP the replicated bias sees a sequence shard; its gradient must be the full one.
    assert_close(layer.bias.grad, full_b.grad, ATOL, "row bias grad")
    assert layer.weight.partition_dim == 1


def _check_embedding(tp, sequence_parallel):
    from hybrid.parallel.layers import VocabParallelEmbedding, default_init
    topo = _setup(tp)
    rank = topo.tp.rank
    emb = VocabParallelEmbedding(VOCAB, H, topo, default_init(seed=7),
                                 reduce_scatter_embeddings=sequence_parallel)
    full_w = torch.empty(VOCAB, H)
    default_init(seed=7)(full_w)
    full_w.requires_grad_()
    ids = torch.randint(0, VOCAB, (S, B), generator=torch.Generator().manual_seed(8))
    ref = F.embedding(ids, full_w)
    grad_out = _inputs(S, B, H, seed=9)
    ref.backward(grad_out)
    out = emb(ids)
    if sequence_parallel:
        assert_close(out, ref.chunk(tp, 0)[rank], ATOL, "embedding output (SP)")
        out.backward(grad_out.chunk(tp, 0)[rank])
    else:
        assert_close(out, ref, ATOL, "embedding output")
        out.backward(grad_out)
    rows = slice(rank * VOCAB // tp, (rank + 1) * VOCAB // tp)
    assert_close(emb.weight.grad, full_w.grad[rows], ATOL, "embedding weight grad")


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_column_parallel_linear_matches_nn_linear(tp, sequence_parallel):
    run_on_ranks(_check_column, tp, tp, sequence_parallel, False)
    if not sequence_parallel:
        run_on_ranks(_check_column, tp, tp, False, True)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_row_parallel_linear_matches_nn_linear(tp, sequence_parallel):
    run_on_ranks(_check_row, tp, tp, sequence_parallel, True)
    if not sequence_parallel:
        run_on_ranks(_check_row, tp, tp, False, False)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_vocab_parallel_embedding_matches_embedding(tp, sequence_parallel):
    run_on_ranks(_check_embedding, tp, tp, sequence_parallel)


def test_zero3s_row_blocks_of_the_tables_load_compute_and_read_back_as_the_tables():
    """ZeRO-3's form of untied vocabulary tables, row blocks (ModelConfig.vocab_block_rows, hybrid.parallel.layers
    .TableBlock): loaded from a whole model's state (load_full_state), the blocked model gives its logits and, its
    blocks joined (join_vocab_blocks), its gradients. At TP 2 each rank's blocks are its shard's rows, and joined
    as ds_to_universal leaves them (each block's TP slices in rank order) they are the table, padding included."""
    import dataclasses

    from hybrid.checkpoint.tp_layout import join_vocab_blocks
    from hybrid.conversion.layout import load_full_state
    from hybrid.model.config import ModelConfig
    from hybrid.model.gpt import GPTModel
    from hybrid.model.naming import canonical_parameters, names_to_load, vocab_block
    from hybrid.parallel.groups import ParallelGroups
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=1000, seed=5,
                         max_position_embeddings=16, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                         attention_dropout=0.0, make_vocab_size_divisible_by=60)
    whole = GPTModel(config, ParallelGroups.single())
    state = {name: p.detach() for name, p in canonical_parameters(whole, 2).items()}
    for tp in (1, 2):
        blocked_config = dataclasses.replace(config, vocab_block_rows=config.zero3_vocab_block_rows(tp), seed=6)
        ranks = [GPTModel(blocked_config, ParallelGroups.shapes_only(tp, rank)) for rank in range(tp)]
        for rank, model in enumerate(ranks):
            assert names_to_load(model, 2) == names_to_load(whole, 2)
            load_full_state(model, state, config, ParallelGroups.shapes_only(tp, rank))
        blocks = [{n: p.detach() for n, p in canonical_parameters(m, 2).items() if vocab_block(n)} for m in ranks]
        assert len(blocks[0]) == 2 * (-(-config.padded_vocab_size(tp) // tp // blocked_config.vocab_block_rows)) > 2
        joined = join_vocab_blocks({n: torch.cat([b[n] for b in blocks]) for n in blocks[0]}, tp)
        for table in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert joined[table].shape[0] == config.padded_vocab_size(tp)
            assert torch.equal(joined[table][:1000], state[table][:1000])
            assert not joined[table][1000:].any()  # the padding rows
    model = GPTModel(dataclasses.replace(config, vocab_block_rows=config.zero3_vocab_block_rows(1), seed=6),
                     ParallelGroups.single())
    load_full_state(model, state, config, ParallelGroups.single())
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    want, got = whole(ids), model(ids)
    assert torch.equal(got, want)
    want.square().mean().backward()
    got.square().mean().backward()
    grads = join_vocab_blocks({n: p.grad for n, p in canonical_parameters(model, 2).items()})
    for name, param in canonical_parameters(whole, 2).items():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-7, msg=name)


def _check_cross_entropy(tp, padded_vocab):
    from hybrid.parallel.cross_entropy import vocab_parallel_cross_entropy
    topo = _setup(tp)
    rank = topo.tp.rank
    true_vocab = VOCAB - 5 if padded_vocab else VOCAB
    logits = (3 * _inputs(S, B, VOCAB, seed=10)).requires_grad_()
    target = torch.randint(0, true_vocab, (S, B), generator=torch.Generator().manual_seed(11))
    target[0, 0] = target[3, 1] = -100  # ignored labels
    ref = F.cross_entropy(logits[..., :true_vocab].reshape(-1, true_vocab), target.reshape(-1),
                          ignore_index=-100)
    ref.backward()
    local = logits.detach().chunk(tp, -1)[rank].clone().requires_grad_()
    per_token = vocab_parallel_cross_entropy(local, target, topo.tp.group, ignore_index=-100,
                                             vocab_size=true_vocab if padded_vocab else None)
    assert per_token.shape == target.shape
    assert per_token[0, 0].item() == 0.0
    loss = per_token.sum() / (target != -100).sum()
    assert_close(loss, ref, ATOL, "cross-entropy loss")
    loss.backward()
    assert_close(local.grad, logits.grad.chunk(tp, -1)[rank], ATOL, "cross-entropy logits grad")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_cross_entropy_matches_torch_with_ignore_index(tp):
    run_on_ranks(_check_cross_entropy, tp, tp, False)


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_cross_entropy_excludes_padded_vocabulary(tp):
    run_on_ranks(_check_cross_entropy, tp, tp, True)


def _count_pair_collectives(tp, sequence_parallel, row_bias):
    import torch.distributed as dist
    from hybrid.parallel.layers import ColumnParallelLinear, RowParallelLinear, default_init
    topo = _setup(tp)
    col = ColumnParallelLinear(H, OUT, topo, default_init(seed=1), sequence_parallel=sequence_parallel)
    row = RowParallelLinear(OUT, H, topo, default_init(seed=2), bias=row_bias,
                            sequence_parallel=sequence_parallel)
    counts = {}
    names = ["all_reduce", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
             "reduce_scatter_tensor", "all_gather", "reduce_scatter", "broadcast", "send", "recv",
             "isend", "irecv", "all_to_all", "all_to_all_single", "barrier"]
    originals = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def counting(name, fn):
        def wrapper(*a, **k):
            counts[phase][name] = counts[phase].get(name, 0) + 1
            return fn(*a, **k)
        return wrapper

    seq = S // tp if sequence_parallel else S
    x = _inputs(seq, B, H, seed=3).requires_grad_()
    try:
        for n, fn in originals.items():
            setattr(dist, n, counting(n, fn))
        phase = "forward"
        counts[phase] = {}
        y = row(col(x))
        phase = "backward"
        counts[phase] = {}
        y.sum().backward()
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)
    return counts


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_row_pair_does_one_all_reduce_each_way(tp):
    counts = run_on_ranks(_count_pair_collectives, tp, tp, False, True)[0]
    expected = {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}} if tp > 1 else \
        {"forward": {}, "backward": {}}
    assert counts == expected


@pytest.mark.parametrize("tp", [2, 4])
def test_column_row_pair_with_sp_does_one_all_gather_and_one_reduce_scatter_each_way(tp):
    counts = run_on_ranks(_count_pair_collectives, tp, tp, True, False)[0]
    assert counts == {"forward": {"all_gather_single": 1, "reduce_scatter_single": 1},
                      "backward": {"all_gather_single": 1, "reduce_scatter_single": 1}}
    # A row bias under SP adds exactly the one all-reduce of its gradient, nothing more.
    counts = run_on_ranks(_count_pair_collectives, tp, tp, True, True)[0]
    assert counts == {"forward": {"all_gather_single": 1, "reduce_scatter_single": 1},
                      "backward": {"all_gather_single": 1, "reduce_scatter_single": 1, "all_reduce": 1}}


def _dropout_masks(tp):
    from hybrid.parallel.random import fork_tp_rng, model_parallel_seed, get_rng_states, set_rng_states
    topo = _setup(tp)
    model_parallel_seed(1234, topo.tp.rank)
    x = torch.ones(4096)
    outside = F.dropout(x, 0.5)
    with fork_tp_rng():
        inside = F.dropout(x, 0.5)
    states = get_rng_states()
    after = F.dropout(x, 0.5)
    with fork_tp_rng():
        after_inside = F.dropout(x, 0.5)
    set_rng_states(states)
    replay = F.dropout(x, 0.5)
    with fork_tp_rng():
        replay_inside = F.dropout(x, 0.5)
    assert torch.equal(after, replay) and torch.equal(after_inside, replay_inside), "RNG state restore"
    return outside, inside


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_rng_tracker_differs_inside_tp_region_and_matches_outside(tp):
    masks = run_on_ranks(_dropout_masks, tp, tp)
    for outside, inside in masks[1:]:
        assert torch.equal(outside, masks[0][0])
        assert not torch.equal(inside, masks[0][1])
    assert not torch.equal(masks[0][0], masks[0][1])
