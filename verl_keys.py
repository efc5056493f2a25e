"""verl v0.5.0's trainer config as data: every key of `verl/trainer/config/ppo_trainer.yaml` as verl composes it
(`python3 -m verl.trainer.main_ppo --cfg job`), with verl's default values, and what minirl does with the verl keys
it does not use. Checked key by key against v0.5.0's `verl/trainer/config/_generated_ppo_trainer.yaml`, which ships
unchanged in tests/data/verl/; test_verl_config.py keeps the two equal (same keys, same resolved defaults).

No logic here: config.py reads these tables. Interpolated defaults (`${...}`) are written as verl resolves them for
its own defaults. Subtrees that are passed whole to a profiler or to Ray are free-form (FREE_FORM): any keys load.
Any key named `_target_` (the dataclass verl builds from a section) is accepted anywhere.
"""

_FSDP = {"wrap_policy": {"min_num_params": 0}, "param_offload": False, "optimizer_offload": False,
         "offload_policy": False, "reshard_after_forward": True, "fsdp_size": -1, "forward_prefetch": False}
_CHECKPOINT = {"save_contents": ["model", "optimizer", "extra"], "load_contents": ["model", "optimizer", "extra"]}
_PROFILER = {"_target_": "verl.utils.profiler.ProfilerConfig", "discrete": False, "all_ranks": False, "ranks": []}
_LOG_PROB = {"log_prob_micro_batch_size": None, "log_prob_micro_batch_size_per_gpu": None,
             "log_prob_use_dynamic_bsz": False, "log_prob_max_token_len_per_gpu": 16384}

VERL_DEFAULTS = {
    "data": {
        "tokenizer": None, "use_shm": False, "train_files": "~/data/rlhf/gsm8k/train.parquet",
        "val_files": "~/data/rlhf/gsm8k/test.parquet", "prompt_key": "prompt", "reward_fn_key": "data_source",
        "max_prompt_length": 512, "max_response_length": 512, "train_batch_size": 1024, "val_batch_size": None,
        "return_raw_input_ids": False, "return_raw_chat": False, "return_full_prompt": False, "shuffle": True,
        "dataloader_num_workers": 8, "validation_shuffle": False, "filter_overlong_prompts": False,
        "filter_overlong_prompts_workers": 1, "truncation": "error", "image_key": "images", "video_key": "videos",
        "trust_remote_code": False, "custom_cls": {"path": None, "name": None}, "return_multi_modal_inputs": True,
        "sampler": {"class_path": None, "class_name": None}, "datagen": {"path": None, "name": None},
    },
    "actor_rollout_ref": {
        "hybrid_engine": True,
        "model": {
            "path": "~/models/deepseek-llm-7b-chat", "custom_chat_template": None, "use_shm": False,
            "external_lib": None, "override_config": {}, "enable_gradient_checkpointing": True,
            "enable_activation_offload": False, "use_remove_padding": False, "lora_rank": 0, "lora_alpha": 16,
            "target_modules": "all-linear", "exclude_modules": None, "use_liger": False, "use_fused_kernels": False,
            "fused_kernel_options": {"impl_backend": "torch"}, "trust_remote_code": False,
        },
        "actor": {
            "strategy": "fsdp", "ppo_mini_batch_size": 256, "ppo_micro_batch_size": None,
            "ppo_micro_batch_size_per_gpu": None, "use_dynamic_bsz": False, "ppo_max_token_len_per_gpu": 16384,
            "clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2,
            "policy_loss": {"loss_mode": "vanilla", "clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0,
                            "kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1},
            "clip_ratio_c": 3.0, "loss_agg_mode": "token-mean", "entropy_coeff": 0, "use_kl_loss": False,
            "use_torch_compile": True, "kl_loss_coef": 0.001, "kl_loss_type": "low_var_kl", "ppo_epochs": 1,
            "shuffle": False, "checkpoint": dict(_CHECKPOINT),
            "optim": {"lr": 1e-6, "lr_warmup_steps_ratio": 0.0, "total_training_steps": -1, "weight_decay": 0.01,
                      "lr_warmup_steps": -1, "min_lr_ratio": 0.0, "num_cycles": 0.5, "warmup_style": "constant"},
            "grad_clip": 1.0, "ulysses_sequence_parallel_size": 1, "entropy_from_logits_with_chunking": False,
            "entropy_checkpointing": False, "fsdp_config": dict(_FSDP),
        },
        "ref": {
            "strategy": "fsdp", "use_torch_compile": True, **_LOG_PROB,
            "fsdp_config": {"param_offload": False, "reshard_after_forward": True, "forward_prefetch": False,
                            "wrap_policy": {"min_num_params": 0}},
            "ulysses_sequence_parallel_size": 1, "entropy_from_logits_with_chunking": False,
            "entropy_checkpointing": False,
        },
        "rollout": {
            "name": "vllm", "mode": "sync", "temperature": 1.0, "top_k": -1, "top_p": 1, "prompt_length": 512,
            "response_length": 512, "dtype": "bfloat16", "gpu_memory_utilization": 0.5, "ignore_eos": False,
            "enforce_eager": True, "free_cache_engine": True, "tensor_model_parallel_size": 2,
            "max_num_batched_tokens": 8192, "max_model_len": None, "max_num_seqs": 1024, **_LOG_PROB,
            "disable_log_stats": True, "do_sample": True, "n": 1, "multi_stage_wake_up": False,
            "engine_kwargs": {"vllm": {"swap_space": None, "disable_mm_preprocessor_cache": False},
                              "sglang": {"attention_backend": None}},
            "val_kwargs": {"top_k": -1, "top_p": 1.0, "temperature": 0, "n": 1, "do_sample": False},
            "multi_turn": {
                "enable": False, "max_assistant_turns": None, "tool_config_path": None, "max_user_turns": None,
                "max_parallel_calls": 1, "max_tool_response_length": 256, "tool_response_truncate_side": "middle",
                "interaction_config_path": None, "completion_callback": None, "use_inference_chat_template": False,
                "tokenization_sanity_check_mode": "strict", "format": "hermes",
            },
            "calculate_log_probs": False,
            "agent": {"num_workers": 8, "agent_loop_config_path": None,
                      "custom_async_server": {"path": None, "name": None}},
            "update_weights_bucket_megabytes": 512, "trace": {"backend": None, "token2text": False},
            "enable_chunked_prefill": True, "load_format": "dummy_dtensor", "layered_summon": False,
        },
        "profiler": dict(_PROFILER),       # one for the actor, ref and rollout roles of the fused worker
    },
    "critic": {
        "_target_": "verl.trainer.config.FSDPCriticConfig", "rollout_n": 1, "strategy": "fsdp",
        "optim": {"lr": 1e-5, "lr_warmup_steps_ratio": 0.0, "min_lr_ratio": None, "warmup_style": "constant",
                  "total_training_steps": -1, "weight_decay": 0.01},
        "model": {"path": "~/models/deepseek-llm-7b-chat", "tokenizer_path": "~/models/deepseek-llm-7b-chat",
                  "override_config": {}, "external_lib": None, "enable_gradient_checkpointing": True,
                  "enable_activation_offload": False, "use_remove_padding": False, "trust_remote_code": False,
                  "use_shm": False, "fsdp_config": dict(_FSDP), "lora_rank": 0, "lora_alpha": 16,
                  "target_modules": "all-linear"},
        "ppo_mini_batch_size": 256, "ppo_micro_batch_size": None, "ppo_micro_batch_size_per_gpu": None,
        "forward_micro_batch_size": None, "forward_micro_batch_size_per_gpu": None, "use_dynamic_bsz": False,
        "ppo_max_token_len_per_gpu": 32768, "forward_max_token_len_per_gpu": 32768,
        "ulysses_sequence_parallel_size": 1, "ppo_epochs": 1, "shuffle": False, "grad_clip": 1.0,
        "cliprange_value": 0.5, "loss_agg_mode": "token-mean", "checkpoint": dict(_CHECKPOINT),
        "profiler": dict(_PROFILER),
    },
    "reward_model": {
        "enable": False, "strategy": "fsdp",
        "model": {"input_tokenizer": "~/models/deepseek-llm-7b-chat", "path": "~/models/FsfairX-LLaMA3-RM-v0.1",
                  "external_lib": None, "use_remove_padding": False, "use_fused_kernels": False,
                  "trust_remote_code": False, "use_shm": False,
                  "fsdp_config": {"wrap_policy": {"min_num_params": 0}, "param_offload": False,
                                  "reshard_after_forward": True, "fsdp_size": -1, "forward_prefetch": False}},
        "micro_batch_size": None, "micro_batch_size_per_gpu": None, "max_length": None,
        "ulysses_sequence_parallel_size": 1, "use_dynamic_bsz": False, "forward_max_token_len_per_gpu": 32768,
        "reward_manager": "naive", "launch_reward_fn_async": False,
        "sandbox_fusion": {"url": None, "max_concurrent": 64, "memory_limit_mb": 1024},
        "profiler": dict(_PROFILER),
    },
    "custom_reward_function": {"path": None, "name": "compute_score"},
    "algorithm": {
        "_target_": "verl.trainer.config.AlgoConfig", "gamma": 1.0, "lam": 1.0, "adv_estimator": "gae",
        "norm_adv_by_std_in_grpo": True, "use_kl_in_reward": False, "kl_penalty": "kl",
        "kl_ctrl": {"_target_": "verl.trainer.config.KLControlConfig", "type": "fixed", "kl_coef": 0.001,
                    "horizon": 10000, "target_kl": 0.1},
        "use_pf_ppo": False,
        "pf_ppo": {"_target_": "verl.trainer.config.PFPPOConfig", "reweight_method": "pow", "weight_pow": 2.0},
    },
    "trainer": {
        "balance_batch": True, "total_epochs": 30, "total_training_steps": None, "profile_steps": None,
        "controller_nsight_options": {"trace": "cuda,nvtx,cublas,ucx", "cuda-memory-usage": "true",
                                      "cuda-graph-trace": "graph"},
        "worker_nsight_options": {"trace": "cuda,nvtx,cublas,ucx", "cuda-memory-usage": "true",
                                  "cuda-graph-trace": "graph", "capture-range": "cudaProfilerApi",
                                  "capture-range-end": None, "kill": "none"},
        "npu_profile": {"options": {"save_path": "./profiler_data", "level": "level1",
                                    "with_memory": False, "record_shapes": False, "with_npu": True, "with_cpu": True,
                                    "with_module": False, "with_stack": False, "analysis": True}},
        "project_name": "verl_examples", "experiment_name": "gsm8k", "logger": ["console", "wandb"],
        "log_val_generations": 0, "rollout_data_dir": None, "validation_data_dir": None, "nnodes": 1,
        "n_gpus_per_node": 8, "save_freq": -1, "esi_redundant_time": 0, "resume_mode": "auto",
        "resume_from_path": None, "val_before_train": True, "val_only": False, "test_freq": -1, "critic_warmup": 0,
        "default_hdfs_dir": None, "del_local_ckpt_after_load": False,
        "default_local_dir": "checkpoints/verl_examples/gsm8k", "max_actor_ckpt_to_keep": None,
        "max_critic_ckpt_to_keep": None, "ray_wait_register_center_timeout": 300, "device": "cuda",
        "use_legacy_worker_impl": "auto",
    },
    "ray_init": {"num_cpus": None, "timeline_json_file": None},
}

# The keys DAPO's recipe adds to verl's tree (recipe/dapo/config/dapo_trainer.yaml, v0.5.0), read by its trainer
# (recipe/dapo/dapo_ray_trainer.py, RayDAPOTrainer.fit): dynamic sampling. --to-verl writes a run that filters
# groups as `python3 -m recipe.dapo.main_dapo`; gen_batch_size null stands for the recipe's ${data.train_batch_size}.
DAPO_RECIPE = {"data.gen_batch_size": None, "algorithm.filter_groups.enable": False,
               "algorithm.filter_groups.metric": None, "algorithm.filter_groups.max_num_gen_batches": 0,
               # main_dapo hands these to DAPORewardManager as overlong_buffer_cfg (max_resp_len: the response length)
               "reward_model.overlong_buffer.enable": False, "reward_model.overlong_buffer.len": 0,
               "reward_model.overlong_buffer.penalty_factor": 0.0, "reward_model.overlong_buffer.log": False}

# Keys verl v0.5.0 reads with a default although its yaml does not declare them (`config.get(key, default)`):
# --to-verl passes them with Hydra's '+'.
VERL_UNDECLARED = {"data.seed": 1,                            # RLHF sampler: data_config.get("seed", 1)
                   "actor_rollout_ref.actor.optim.betas": [0.9, 0.999],   # fsdp_workers: optim_config.get("betas")
                   "critic.optim.betas": [0.9, 0.999],
                   "critic.optim.lr_warmup_steps": -1,                    # fsdp_workers: config.optim.get(...)
                   "reward_model.reward_kwargs": {},     # trainer/ppo/reward.py: reward_model.get("reward_kwargs", {})
                   # fsdp_workers: fsdp_config.get("model_dtype") (null: fp32 for actor and critic, bf16 for ref) and
                   # fsdp_config.get("mixed_precision") (null: bf16 parameters, fp32 reduction and buffers)
                   **{f"{role}.fsdp_config.{key}": None for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref",
                                                                     "critic.model")
                      for key in ("model_dtype", "mixed_precision")}}

# Subtrees handed whole to a profiler, Ray or an engine: any keys inside load.
FREE_FORM = (
    "actor_rollout_ref.profiler", "critic.profiler", "reward_model.profiler", "trainer.controller_nsight_options",
    "trainer.worker_nsight_options",
    "trainer.npu_profile", "ray_init",
)

# verl keys that load (so verl configs work) but change nothing in minirl: set to anything but their default, they
# earn one warning naming them. A key ending in '.' covers its whole subtree; a longer entry inside a subtree wins,
# and None there says minirl does read that key.
NO_EFFECT = {
    "data.use_shm": "files are read from their local path",
    "data.val_batch_size": "validation generates the whole set at once (verl's default)",
    "data.return_raw_input_ids": "the raw prompt ids always travel with the batch",
    "data.return_full_prompt": "not returned",
    "data.dataloader_num_workers": "prompts are loaded in the trainer process",
    "data.validation_shuffle": "validation keeps the file order",
    "data.filter_overlong_prompts_workers": "filtering runs in the trainer process",
    "data.custom_cls.": "the dataset class is fixed",
    "data.datagen.": "the dataset class is fixed",
    "data.return_multi_modal_inputs": "rows with images always carry their multimodal inputs",
    "actor_rollout_ref.model.use_shm": "models are read from their local path",
    "actor_rollout_ref.model.external_lib": "not imported",
    "actor_rollout_ref.model.enable_activation_offload": "activations stay on the device",
    "actor_rollout_ref.model.use_liger": "no Liger kernels",
    "actor_rollout_ref.model.use_fused_kernels": "no fused log-prob kernels",
    "actor_rollout_ref.model.fused_kernel_options.": "no fused log-prob kernels",
    "actor_rollout_ref.actor.entropy_checkpointing": "entropy is not checkpointed",
    "actor_rollout_ref.actor.shuffle": "mini-batches keep their order (verl ignores it too)",
    "actor_rollout_ref.actor.fsdp_config.": "FSDP2 shards every decoder layer and the root, fp32 master weights",
    "actor_rollout_ref.actor.fsdp_config.reshard_after_forward": None,
    "actor_rollout_ref.ref.fsdp_config.": "FSDP2 shards every decoder layer and the root",
    "actor_rollout_ref.ref.fsdp_config.reshard_after_forward": None,
    "actor_rollout_ref.ref.entropy_": "the reference model computes no entropy",
    "actor_rollout_ref.ref.strategy": "the reference model uses the actor's FSDP2",
    "critic.model.fsdp_config.": "FSDP2 shards every decoder layer and the root, fp32 master weights",
    "critic.model.fsdp_config.reshard_after_forward": None,
    "critic.model.external_lib": "not imported",
    "critic.model.enable_activation_offload": "activations stay on the device",
    "critic.model.use_shm": "models are read from their local path",
    "reward_model.model.fsdp_config.": "FSDP2 shards every decoder layer and the root",
    "reward_model.model.fsdp_config.reshard_after_forward": None,
    # read: models.fsdp_mesh (HSDP over groups of fsdp_size ranks)
    **{f"{role}.fsdp_config.fsdp_size": None
       for role in ("actor_rollout_ref.actor", "critic.model", "reward_model.model")},
    # read: models.Worker offloads between phases (verl's manual offload); FSDP2's own CPUOffloadPolicy is not used
    **{f"{role}.fsdp_config.param_offload": None
       for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model", "reward_model.model")},
    **{f"{role}.fsdp_config.optimizer_offload": None for role in ("actor_rollout_ref.actor", "critic.model")},
    **{f"{role}.fsdp_config.offload_policy": "FSDP2's CPUOffloadPolicy is not used; param_offload and "
       "optimizer_offload keep the model and optimizer state in host memory between phases"
       for role in ("actor_rollout_ref.actor", "critic.model")},
    "reward_model.model.external_lib": "not imported",
    "reward_model.model.use_fused_kernels": "no fused kernels",
    "reward_model.model.use_shm": "models are read from their local path",
    "reward_model.ulysses_sequence_parallel_size": "the reward model runs without sequence parallelism",
    "reward_model.launch_reward_fn_async": "rewards are computed in the step",
    "reward_model.sandbox_fusion.max_concurrent": "no sandbox is used",
    "reward_model.sandbox_fusion.memory_limit_mb": "no sandbox is used",
    "actor_rollout_ref.rollout.layered_summon": "weights are gathered in buckets of update_weights_bucket_megabytes",
    "actor_rollout_ref.rollout.calculate_log_probs": "the engine's log-probs are always compared (rollout_probs_diff)",
    "actor_rollout_ref.rollout.multi_stage_wake_up": "vLLM wakes weights and cache together",
    "actor_rollout_ref.rollout.agent.": "the agent loop runs only in async mode",
    "actor_rollout_ref.rollout.trace.": "no rollout tracing",
    "actor_rollout_ref.rollout.multi_turn.completion_callback": "multi-turn uses minirl's own loop",
    "actor_rollout_ref.rollout.multi_turn.max_turns":
        "an older verl's turn limit, not a key of verl v0.5.0 (whose run ignores it too); the turn limits are "
        "max_assistant_turns and max_user_turns",
    "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template":
        "the tokens trained are those the model read while generating (earlier turns are never re-templated)",
    "trainer.default_hdfs_dir": "checkpoints are written locally",
    "trainer.del_local_ckpt_after_load": "checkpoints are kept",
    "trainer.profile_steps": "no profiler",
    "trainer.controller_nsight_options.": "no profiler",
    "trainer.worker_nsight_options.": "no profiler",
    "trainer.npu_profile.": "no profiler",
    "trainer.esi_redundant_time": "no elastic-server checkpointing",
    "trainer.ray_wait_register_center_timeout": "no Ray",
    "trainer.use_legacy_worker_impl": "minirl has one worker implementation",
    "ray_init.": "no Ray",
    "actor_rollout_ref.profiler.": "no profiler",
    "critic.profiler.": "no profiler",
    "reward_model.profiler.": "no profiler",
}
