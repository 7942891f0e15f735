"""ClientState: the one owner of what hybrid adds to DeepSpeed's checkpoint files, as typed records."""

from hybrid.checkpoint.client_state import ClientState, SavedLayout


def test_round_trip_leaves_deepspeeds_own_keys_out():
    state = ClientState(iteration=3, consumed_samples=24, model={"num_layers": 2},
                        layout=SavedLayout(tensor_parallel=2, zero_stage=1), args={"lr": 1e-3},
                        optimizer_param_names=[["a"]])
    meta = dict(state.to_dict(), module={"w": 1}, ds_config={"zero_optimization": {"stage": 3}}, global_steps=3)
    again = ClientState.from_meta(meta)
    assert again == state
    assert set(state.to_dict()) == {"iteration", "consumed_samples", "model", "layout", "run", "args", "rng_states",
                                    "universal_checkpoint_info", "optimizer_param_names", "weights_only"}
    assert isinstance(state.to_dict()["layout"], dict)  # plain values only: the files load with weights_only=True


def test_storage_is_chosen_from_the_recorded_layout():
    def storage(weights_only=False, **layout):
        return ClientState(layout=SavedLayout(**layout), weights_only=weights_only).storage
    assert storage(pipeline_parallel=1, zero_stage=1) == "module"
    assert storage(pipeline_parallel=1, zero_stage=3) == "zero3"
    assert storage(pipeline_parallel=1, zero_stage=3, weights_only=True) == "module"
    assert storage(pipeline_parallel=2, pipeline_schedule="1f1b") == "layer_files"
    assert storage(pipeline_parallel=2, pipeline_schedule="zbv") == "virtual_stages"
    assert storage(pipeline_parallel=2, pipeline_schedule="zbv", weights_only=True) == "layer_files"


def test_checkpoints_from_before_zero_stage_was_recorded_take_it_from_deepspeeds_config():
    old = {"iteration": 4, "hybrid_config": {"tensor_parallel": 1, "pipeline_parallel": 1},
           "ds_config": {"zero_optimization": {"stage": 3}}}
    state = ClientState.from_meta(old)
    assert state.layout.zero_stage == 3 and state.storage == "zero3" and state.iteration == 4


def test_checkpoints_of_the_one_dict_format_read_as_typed_records():
    old = {"iteration": 7, "hybrid_config": {"model": {"num_layers": 3}, "train": {"lr": 0.1}, "tensor_parallel": 2,
                                             "pipeline_parallel": 2, "pipeline_schedule": "zbv", "virtual_stages": 2,
                                             "zero_stage": 1, "expert_parallel": 2}}
    state = ClientState.from_meta(old)
    assert state.model == {"num_layers": 3} and state.run == {"train": {"lr": 0.1}}
    assert state.layout == SavedLayout(tensor_parallel=2, pipeline_parallel=2, pipeline_schedule="zbv",
                                       virtual_stages=2, zero_stage=1, expert_parallel=2)
    assert state.storage == "virtual_stages"
    # a newer writer's extra fields are ignored, not an error
    assert ClientState.from_meta({"layout": {"tensor_parallel": 4, "some_new_axis": 8}}).layout.tensor_parallel == 4


def test_no_save_rng_leaves_the_rng_states_out_and_no_save_optim_is_refused(tmp_path):
    import pytest

    from hybrid.config import build_run_config
    from hybrid.errors import ConfigError
    from hybrid.flags import build_parser
    from hybrid.training.saving import write_files
    from tests.test_capabilities import BASE

    class Engine:  # records what DeepSpeed's save_checkpoint would write as client state
        def save_checkpoint(self, save_dir, tag, client_state, save_latest):
            self.saved = client_state

    def saved(*flags):
        run = build_run_config(build_parser().parse_args([str(f) for f in BASE + ["--zero-stage", 1, *flags]]), 1, 64)
        engine = Engine()
        assert write_files(engine, run, str(tmp_path), 3, 24) == "iter_0000003"
        return ClientState.from_meta(engine.saved)

    assert saved().rng_states is not None
    state = saved("--no-save-rng")
    assert state.rng_states is None and state.iteration == 3 and state.consumed_samples == 24
    with pytest.raises(ConfigError, match="--no-save-optim.*always writes the optimizer state"):
        build_run_config(build_parser().parse_args([str(f) for f in BASE + ["--no-save-optim"]]), 1, 64)


def test_a_plain_resume_builds_the_vocabulary_tables_as_its_zero3_checkpoint_held_them(tmp_path):
    """Under ZeRO-3 an untied table is row blocks (RunConfig.model_form); a checkpoint records their rows in its
    layout, and a plain resume of a ZeRO-3 checkpoint takes them from the checkpoint it loads (the newest complete
    one), so DeepSpeed's own load finds the names it wrote: whole tables for a checkpoint from before the blocks (no
    record), the checkpoint's blocks otherwise. --finetune, universal loads and the loads of other checkpoints read
    whole tables into any form, and take this run's."""
    import torch

    from hybrid.checkpoint.manifest import write_manifest
    from hybrid.config import build_run_config
    from hybrid.flags import build_parser
    flags = ["--num-layers", 2, "--hidden-size", 32, "--num-attention-heads", 4, "--seq-length", 16,
             "--max-position-embeddings", 16, "--micro-batch-size", 1, "--global-batch-size", 2, "--train-iters", 8,
             "--lr", 1e-3, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", 1000,
             "--untie-embeddings-and-output-weights", "--zero-stage", 3]

    def form(*extra):
        run = build_run_config(build_parser().parse_args([str(f) for f in flags + list(extra)]), 2, 1001)
        assert run.saved_layout().vocab_block_rows == run.model_form.vocab_block_rows
        return run.model_form.vocab_block_rows

    def checkpoint(load, iteration, weights_only=False, **layout):
        tag = load / f"iter_{iteration:07d}"
        tag.mkdir(parents=True)
        (load / "latest").write_text(tag.name)
        saved = dict(SavedLayout(data_parallel=2, **layout).to_dict())
        if "vocab_block_rows" not in layout:
            del saved["vocab_block_rows"]  # written before the blocks
        torch.save(dict(ClientState(iteration=iteration, model={"num_layers": 2}, weights_only=weights_only).to_dict(),
                        layout=saved), tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")
        write_manifest(str(tag))
        return tag

    fresh = form()
    assert fresh > 0 and form("--zero-stage", 1) == 0
    cases = {"before_blocks": ({"zero_stage": 3}, 0), "blocks": ({"zero_stage": 3, "vocab_block_rows": 256}, 256),
             "zero1": ({"zero_stage": 1}, fresh), "weights_only": ({"zero_stage": 3, "weights_only": True}, fresh)}
    for name, (layout, want) in cases.items():
        weights_only = layout.pop("weights_only", False)
        checkpoint(tmp_path / name, 4, weights_only, **layout)
        assert form("--load", tmp_path / name) == want, name
        assert form("--load", tmp_path / name, "--finetune") == fresh
        assert form("--load", tmp_path / name, "--universal-checkpoint") == fresh
    # the newest checkpoint is incomplete (a file is not as its manifest lists it): resume takes the one before
    newest = checkpoint(tmp_path / "before_blocks", 8, zero_stage=3, vocab_block_rows=256)
    (newest / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"truncated")
    assert form("--load", tmp_path / "before_blocks") == 0
