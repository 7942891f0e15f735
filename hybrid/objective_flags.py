"""The post-training objectives' flags: --sft, --dpo and --grpo checked against each other (TRL's rules where TRL has
them) and --grpo's options made for the layout. hybrid.config calls them while it builds the run's configuration."""

from __future__ import annotations

from hybrid.data import gym_tasks
from hybrid.data.arithmetic import DEFAULT_REWARDS
from hybrid.distributed import log
from hybrid.errors import ConfigError
from hybrid.model.grpo import GRPOOptions


def sft_flags(args) -> None:
    """--sft: conversations packed with their document masks and positions, the loss a token mean."""
    if args.dpo:
        _dpo_flags(args)
    elif (args.dpo_beta != 0.1 or args.dpo_label_smoothing or args.dpo_loss_type != "sigmoid"
          or args.dpo_reference_logps or args.dpo_max_length or args.dpo_max_prompt_length
          or args.dpo_truncation_mode != "keep_start"):
        raise ConfigError("--dpo-beta / --dpo-label-smoothing / --dpo-loss-type / --dpo-reference-logps / "
                          "--dpo-max-length / --dpo-max-prompt-length / --dpo-truncation-mode set DPO: add --dpo.")
    if not (args.sft or args.dpo):
        if args.sft_train_on_prompt or args.sft_skip_bad or args.sft_truncation != "truncate" or args.sft_streaming:
            raise ConfigError("--sft-train-on-prompt / --sft-skip-bad / --sft-truncation / --sft-streaming shape chat "
                              "data: add --sft.")
        return
    if args.sft_streaming:
        _streaming_flags(args)
    if args.mock_data:
        raise ConfigError("--sft trains on conversations: give --data-path FILE (JSONL or Parquet with 'messages', "
                          "'conversations', Alpaca or pre-tokenized rows, or a datasets save_to_disk directory), or "
                          "no data flag for the embedded chat set; not --mock-data.")
    # packed conversations: no attention across them, positions from 0 in each, every assistant token weighs the same
    args.reset_attention_mask = args.reset_position_ids = args.calculate_per_token_loss = True


GRPO_DEFAULTS = {"reward_function": None, "reward_weights": None, "grpo_group_size": 8, "grpo_epsilon": 0.2,
                 "grpo_epsilon_high": None, "grpo_beta": 0.0, "grpo_loss_type": "dapo", "grpo_scale_rewards": "group",
                 "grpo_iterations": 1, "max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                 "grpo_importance_sampling_level": "token", "grpo_delta": None, "grpo_sapo_temperature_pos": 1.0,
                 "grpo_sapo_temperature_neg": 1.05, "grpo_vespo_k_pos": 2.0, "grpo_vespo_lambda_pos": 3.0,
                 "grpo_vespo_k_neg": 3.0, "grpo_vespo_lambda_neg": 2.0, "grpo_rollout_correction": None,
                 "grpo_rollout_correction_clip_min": None, "grpo_rollout_correction_clip_max": 3.0,
                 "grpo_off_policy_mask_threshold": None, "grpo_mask_truncated_completions": False,
                 "grpo_top_entropy_quantile": 1.0, "grpo_environment": None, "grpo_max_turns": 4,
                 "grpo_max_tokens_per_turn": None, "grpo_reasoning_gym": None, "grpo_reasoning_gym_size": None,
                 "grpo_dynamic_sampling": False, "grpo_dynamic_sampling_max_rounds": 8}


def grpo_flags(args) -> None:
    """--grpo's flags checked against each other (the batch against the layout: grpo_options)."""
    if not args.grpo:
        given = [f"--{k.replace('_', '-')}" for k, v in GRPO_DEFAULTS.items() if getattr(args, k) != v]
        given += ["--moe-routing-replay"] if args.moe_routing_replay else []
        if given:
            raise ConfigError(f"{' / '.join(given)} set GRPO: add --grpo.")
        return
    if args.sft or args.dpo:
        raise ConfigError("--grpo with --sft or --dpo: three trainings (on the engine's completions; conversations; "
                          "preference pairs); give one.")
    if args.mock_data or args.reset_attention_mask or args.reset_position_ids:
        raise ConfigError("--grpo trains on one completion per row: --mock-data, --reset-attention-mask and "
                          "--reset-position-ids do not apply; drop them.")
    # the trainer's log-probabilities are the sampler's only without dropout (TRL's disable_dropout, its default)
    args.hidden_dropout = args.attention_dropout = 0.0
    if getattr(args, "lora_dropout", None):
        args.lora_dropout = 0.0
    if args.grpo_group_size < 2:
        raise ConfigError(f"--grpo-group-size {args.grpo_group_size}: advantages compare completions of one prompt; "
                          f"give at least 2.")
    if args.temperature <= 0 or not 0.0 < args.top_p <= 1.0 or args.top_k < 0:
        raise ConfigError(f"--temperature {args.temperature} / --top-p {args.top_p} / --top-k {args.top_k}: GRPO "
                          f"samples: a temperature > 0, top-p in (0, 1], top-k 0 (off) or more.")
    if args.max_new_tokens < 1 or args.grpo_iterations < 1 or args.grpo_epsilon <= 0 or args.grpo_beta < 0:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens} and --grpo-iterations {args.grpo_iterations} "
                          f"take at least 1, --grpo-epsilon {args.grpo_epsilon} > 0, --grpo-beta {args.grpo_beta} >= "
                          f"0.")
    if args.grpo_epsilon_high is not None and args.grpo_epsilon_high <= 0:
        raise ConfigError(f"--grpo-epsilon-high {args.grpo_epsilon_high}: give a positive clip.")
    _grpo_objective_flags(args)
    if args.moe_routing_replay == "R2" and args.grpo_iterations < 2:
        raise ConfigError("--moe-routing-replay R2 replays the first pass's routing in the later passes over a batch: "
                          "with --grpo-iterations 1 there are none; give --grpo-iterations 2 or more, or R3 (the "
                          "generator's routing).")
    if args.grpo_beta > 0 and not args.load_hf:
        raise ConfigError("--grpo-beta > 0 needs --load-hf DIR: the KL is to that starting model, kept frozen.")
    _environment_flags(args)
    if args.grpo_dynamic_sampling_max_rounds < 1 or (args.grpo_dynamic_sampling_max_rounds != 8 and
                                                     not args.grpo_dynamic_sampling):
        raise ConfigError(f"--grpo-dynamic-sampling-max-rounds {args.grpo_dynamic_sampling_max_rounds}: give 1 or "
                          f"more, with --grpo-dynamic-sampling.")
    if args.grpo_reasoning_gym_size is not None and not args.grpo_reasoning_gym:
        raise ConfigError("--grpo-reasoning-gym-size sizes reasoning_gym's tasks: add --grpo-reasoning-gym TASK.")
    if args.grpo_reasoning_gym_size is None:
        args.grpo_reasoning_gym_size = 1000
    if args.grpo_reasoning_gym and (args.data_path or args.grpo_reasoning_gym_size < 1):
        raise ConfigError("--grpo-reasoning-gym makes the prompts: drop --data-path (one prompt source), and give "
                          "--grpo-reasoning-gym-size 1 or more.")
    functions = args.reward_function
    if functions is None and args.grpo_reasoning_gym:
        functions = [gym_tasks.REWARD]  # reasoning_gym's own scorer
    elif functions is None and args.grpo_environment:
        functions = []  # the environment's rewards alone
    elif functions is None:
        if args.data_path:
            raise ConfigError("--grpo with --data-path needs --reward-function FILE.py:NAME (TRL's signature: "
                              "prompts, completions, completion_ids, **columns -> list of floats).")
        functions = list(DEFAULT_REWARDS)
    if args.reward_weights is not None and len(args.reward_weights) != len(functions):
        raise ConfigError(f"--reward-weights: {len(args.reward_weights)} weights for {len(functions)} "
                          f"--reward-function entries; give one weight per function.")
    args.reward_function = functions
    for flag in ("save_interval", "exit_interval"):
        value = getattr(args, flag, None)
        if value and args.grpo_iterations > 1 and value % args.grpo_iterations:
            raise ConfigError(f"--{flag.replace('_', '-')} {value}: with --grpo-iterations {args.grpo_iterations} a "
                              f"checkpoint inside a generation batch could not resume it exactly (its completions "
                              f"would be generated again from the updated weights); give a multiple of "
                              f"{args.grpo_iterations}.")
    if args.seq_length is not None and args.max_new_tokens > args.seq_length:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens} exceeds --seq-length {args.seq_length}: a prompt "
                          f"and its completion share one training window.")


def _environment_flags(args) -> None:
    """--grpo-environment's turns and budget."""
    if not args.grpo_environment:
        if args.grpo_max_turns != 4 or args.grpo_max_tokens_per_turn is not None:
            raise ConfigError("--grpo-max-turns / --grpo-max-tokens-per-turn shape multi-turn rollouts: add "
                              "--grpo-environment FILE.py:NAME.")
        return
    per_turn = args.grpo_max_tokens_per_turn
    if args.grpo_max_turns < 1 or (per_turn is not None and per_turn < 1):
        raise ConfigError(f"--grpo-max-turns {args.grpo_max_turns} / --grpo-max-tokens-per-turn {per_turn}: give at "
                          f"least 1.")
    if args.moe_routing_replay:
        raise ConfigError("--moe-routing-replay with --grpo-environment: the replay records one generation per row, "
                          "and an episode is several; drop one of them.")


def _grpo_objective_flags(args) -> None:
    """TRL's rules between the objective's flags: its errors refused, its warnings logged."""
    loss, level, correction = args.grpo_loss_type, args.grpo_importance_sampling_level, args.grpo_rollout_correction
    if args.grpo_delta is not None and args.grpo_delta <= 1:
        raise ConfigError(f"--grpo-delta {args.grpo_delta}: the ratio's upper bound must exceed 1 (TRL's delta).")
    if correction is None and (args.grpo_rollout_correction_clip_min is not None or
                               args.grpo_rollout_correction_clip_max != 3.0):
        raise ConfigError("--grpo-rollout-correction-clip-min / -max bound --grpo-rollout-correction: give a mode "
                          "(token_truncate, token_mask, sequence_truncate, sequence_mask).")
    low, high = args.grpo_rollout_correction_clip_min, args.grpo_rollout_correction_clip_max
    if correction and correction.endswith("truncate") and high is None:
        raise ConfigError(f"--grpo-rollout-correction {correction} truncates at --grpo-rollout-correction-clip-max: "
                          f"give one.")
    if low is not None and high is not None and not 0 <= low < high:
        raise ConfigError(f"--grpo-rollout-correction-clip-min {low} / -max {high}: give 0 <= min < max.")
    if loss == "vespo" and correction and correction.startswith("sequence"):
        raise ConfigError(f"--grpo-loss-type vespo with --grpo-rollout-correction {correction}: VESPO folds the "
                          f"correction into its sequence weight per token; give token_truncate or token_mask (TRL's "
                          f"rule).")
    if not 0.0 <= args.grpo_top_entropy_quantile <= 1.0:
        raise ConfigError(f"--grpo-top-entropy-quantile {args.grpo_top_entropy_quantile}: give a share in [0, 1] (1.0: "
                          f"every token; 0.0: the highest-entropy tokens only, as TRL's).")
    if args.grpo_off_policy_mask_threshold is not None and args.grpo_off_policy_mask_threshold < 0:
        raise ConfigError(f"--grpo-off-policy-mask-threshold {args.grpo_off_policy_mask_threshold}: a KL bound, >= 0.")
    if loss == "cispo" and args.grpo_epsilon_high is None:
        log(f"--grpo-loss-type cispo clips its ratio at --grpo-epsilon-high, here --grpo-epsilon {args.grpo_epsilon} "
            f"(TRL's documentation suggests --grpo-epsilon-high 5.0 for CISPO)")
    if loss == "luspo" and level != "sequence":
        log("--grpo-loss-type luspo: the paper's setup takes --grpo-importance-sampling-level sequence (TRL warns "
            "the same)")
    if loss == "vespo" and level != "token":
        log("--grpo-loss-type vespo computes sequence weights itself: --grpo-importance-sampling-level token is its "
            "setup (TRL warns the same)")
    if level == "sequence" and loss in ("bnpo", "dr_grpo", "dapo", "cispo"):
        log(f"--grpo-importance-sampling-level sequence with --grpo-loss-type {loss}: its token sums weigh each "
            f"sequence by its length; GSPO's setup is --grpo-loss-type grpo (TRL warns the same)")


def grpo_options(args, global_batch: int, dp: int, split: int = 1) -> GRPOOptions:
    """--grpo's options; the global batch (completions) in whole prompt groups on every data-parallel rank, at least
    one completion for each rank of a sequence split to sample."""
    g = args.grpo_group_size
    if global_batch % (g * dp):
        raise ConfigError(f"--global-batch-size {global_batch}: --grpo counts completions, in whole groups of "
                          f"--grpo-group-size {g} on each of the {dp} data-parallel ranks: give a multiple of "
                          f"{g * dp}.")
    if global_batch // dp < split:
        raise ConfigError(f"--global-batch-size {global_batch}: each of the {split} ranks of the sequence split "
                          f"samples a share of its data-parallel rank's {global_batch // dp} completions: give at "
                          f"least {split * dp}.")
    return GRPOOptions(g, args.grpo_epsilon, args.grpo_epsilon_high, args.grpo_beta, args.grpo_loss_type,
                       args.grpo_scale_rewards, args.grpo_iterations, args.max_new_tokens, args.temperature,
                       args.top_p, args.top_k, tuple(args.reward_function), tuple(args.reward_weights or ()),
                       args.grpo_importance_sampling_level, args.grpo_delta, args.grpo_sapo_temperature_pos,
                       args.grpo_sapo_temperature_neg, args.grpo_vespo_k_pos, args.grpo_vespo_lambda_pos,
                       args.grpo_vespo_k_neg, args.grpo_vespo_lambda_neg, args.grpo_rollout_correction,
                       args.grpo_rollout_correction_clip_min, args.grpo_rollout_correction_clip_max,
                       args.grpo_off_policy_mask_threshold, args.grpo_mask_truncated_completions,
                       args.grpo_top_entropy_quantile, args.grpo_environment, args.grpo_max_turns,
                       args.grpo_max_tokens_per_turn, tuple(args.grpo_reasoning_gym or ()),
                       args.grpo_reasoning_gym_size, args.grpo_dynamic_sampling,
                       args.grpo_dynamic_sampling_max_rounds)


def _streaming_flags(args) -> None:
    """--sft-streaming: what needs every window before the first iteration cannot stream."""
    if args.sft_shuffle_buffer < 1:
        raise ConfigError(f"--sft-shuffle-buffer {args.sft_shuffle_buffer}: at least 1 (1: the file's order).")
    if args.dpo and args.dpo_reference_logps:
        raise ConfigError("--dpo-reference-logps with --sft-streaming: the reference values are scored for every "
                          "window before the first iteration; drop --sft-streaming (or --dpo-reference-logps).")


def _dpo_flags(args) -> None:
    if args.sft:
        raise ConfigError("--sft and --dpo are two trainings (on conversations; on preference pairs); give one.")
    if not args.load_hf:
        raise ConfigError("--dpo needs --load-hf DIR: the model to start from, which also stays, frozen, as the "
                          "reference model.")
    if not (args.data_path or args.train_data_path):
        raise ConfigError("--dpo needs --data-path FILE of preference pairs (TRL's prompt / chosen / rejected rows).")
    if args.dpo_beta <= 0 or not 0 <= args.dpo_label_smoothing < 0.5:
        raise ConfigError(f"--dpo-beta {args.dpo_beta} must be positive and --dpo-label-smoothing "
                          f"{args.dpo_label_smoothing} in [0, 0.5).")
    if args.dpo_label_smoothing and args.dpo_loss_type != "sigmoid":
        raise ConfigError("--dpo-label-smoothing applies to --dpo-loss-type sigmoid only (as TRL's).")
    if args.sft_train_on_prompt or args.sft_truncation != "truncate":
        raise ConfigError("--sft-train-on-prompt / --sft-truncation shape conversations; --dpo scores each answer "
                          "and cuts pairs as TRL does: use --dpo-max-length / --dpo-max-prompt-length / "
                          "--dpo-truncation-mode.")
    half = args.seq_length // 2
    if args.dpo_max_length < 0 or args.dpo_max_prompt_length < 0 or args.dpo_max_length > half:
        raise ConfigError(f"--dpo-max-length {args.dpo_max_length} / --dpo-max-prompt-length "
                          f"{args.dpo_max_prompt_length}: a pair's two sides share one window of --seq-length + 1 "
                          f"tokens, so each side holds at most {half} (--seq-length {args.seq_length} / 2; the "
                          f"default); raise --seq-length to twice the side's length, or lower the flag.")
