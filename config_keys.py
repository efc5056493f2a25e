"""minirl's key table: every config key with its default, the types it accepts and, for numbers, its valid range,
declared once; the choices, the refusals, and the schema (this table plus the verl keys of verl_keys.py) that
config.py loads and checks against. Data and the few helpers that read it; loading and checking live in config.py.
"""
from __future__ import annotations

import copy

from data import TRUNCATION_MODES
from losses import ADVANTAGE_ESTIMATORS, KL_PENALTY_KINDS, LOSS_AGG_MODES, PF_PPO_METHODS, POLICY_LOSS_MODES
from verl_keys import DAPO_RECIPE, FREE_FORM, VERL_DEFAULTS


class Key:
    """One leaf of the key table: its default, the types it accepts (a type, a tuple of types, [type] for a list
    of them, dict for a free-form mapping) and, for numbers, its valid range in interval notation."""

    def __init__(self, default, valid=None, kinds=None, why=""):
        self.default, self.valid, self.why = default, valid, why
        self.kinds = kinds if kinds is not None else _kind_of(default)
        self.nullable = default is None


def _kind_of(default):
    if isinstance(default, list):
        return [type(default[0]) if default else str]
    return None if default is None else type(default)


def null(kinds, valid=None):
    """A key whose default is null and that holds `kinds` when set (verl's `key: null`)."""
    return Key(None, valid, kinds)


def free(default=None):
    """A free-form mapping: any keys inside pass through (e.g. engine_kwargs.vllm, override_config)."""
    return Key(default or {}, kinds=dict)


# Valid ranges, written once (interval notation; 'a or [..]' adds a special value).
SIZE, COUNT, POSITIVE, UNIT, SEED = "[1, inf)", "[0, inf)", "(0, inf)", "[0, 1]", "[0, 4294967296)"
OFF_OR_SIZE, OFF_OR_COUNT = "-1 or [1, inf)", "-1 or [0, inf)"
TOP_K = "-1 or [0, inf)"        # -1 and 0 both sample from every token: verl's comment gives 0 for its HF rollout
_TOP_K_WHY = "-1 or 0 for all tokens, k >= 1 for the k likeliest"

# fsdp_config: minirl reads reshard_after_forward (models.shard_fsdp2; FSDP2 shards every decoder layer); the rest
# are the ranges of verl's numbers, and the two keys verl v0.5.0's fsdp_workers reads for actor, ref and critic
# without declaring them (model_dtype, and mixed_precision: a mapping of param_dtype/reduce_dtype/buffer_dtype).
# verl's other keys come from verl_keys.
_WRAP_POLICY = {"min_num_params": Key(0, COUNT)}
_DTYPES = {"model_dtype": null(str), "mixed_precision": Key(None, kinds=dict)}
_FSDP_CONFIG = {"fsdp_size": Key(-1, OFF_OR_SIZE), "wrap_policy": _WRAP_POLICY, "reshard_after_forward": True,
                **_DTYPES}                                                                      # actor, critic
_OPTIM = {"lr": Key(1e-6, POSITIVE), "betas": Key([0.9, 0.999], "[0, 1)", [float]),
          "weight_decay": Key(0.01, COUNT), "lr_warmup_steps": Key(-1, OFF_OR_COUNT),
          "lr_warmup_steps_ratio": Key(0.0, UNIT), "warmup_style": "constant", "min_lr_ratio": Key(0.0, UNIT),
          "num_cycles": Key(0.5, COUNT), "total_training_steps": Key(-1, OFF_OR_SIZE)}
_LOG_PROB = {"log_prob_micro_batch_size": null(int, SIZE), "log_prob_micro_batch_size_per_gpu": null(int, SIZE),
             "log_prob_use_dynamic_bsz": null(bool), "log_prob_max_token_len_per_gpu": null(int, SIZE)}
_CHECKPOINT = {"save_contents": ["model", "optimizer", "extra"], "load_contents": ["model", "optimizer", "extra"]}
_TEMPERATURE_WHY = ("log-probs are computed on logits / temperature, so 0 divides by zero, and the n responses of "
                    "a group would all be the same greedy one; use val_kwargs.temperature=0 for greedy validation")

# minirl's key table: verl v0.5.0's defaults (verl's own table is verl_keys.VERL_DEFAULTS) for every key minirl
# reads, with the type and valid range of each. verl's remaining keys are added from verl_keys.py; a yaml key in
# neither is an error (with a suggestion).
DEFAULTS = {
    "af_output_dir": "outputs",
    "data": {
        "tokenizer": null(str), "use_shm": False, "train_files": null((str, [str])), "val_files": null((str, [str])),
        "prompt_key": "prompt", "reward_fn_key": "data_source", "max_prompt_length": Key(512, SIZE),
        "max_response_length": Key(512, SIZE), "train_batch_size": Key(1024, SIZE), "val_batch_size": null(int, SIZE),
        "return_raw_input_ids": False, "return_raw_chat": False, "return_full_prompt": False, "shuffle": True,
        "seed": Key(1, SEED), "dataloader_num_workers": Key(0, COUNT), "validation_shuffle": False,
        "filter_overlong_prompts": False, "filter_overlong_prompts_workers": Key(1, SIZE), "truncation": "error",
        "image_key": "images", "video_key": "videos", "trust_remote_code": False,
        "custom_cls": {"path": null(str), "name": null(str)},
        "gen_batch_size": null(int, SIZE),       # DAPO's recipe (verl_keys.DAPO_RECIPE): prompts per generation
    },
    "actor_rollout_ref": {
        "hybrid_engine": True,
        "model": {
            "path": null(str), "custom_chat_template": null(str), "use_shm": False, "external_lib": null(str),
            "override_config": free(), "enable_gradient_checkpointing": True, "enable_activation_offload": False,
            "use_remove_padding": False, "lora_rank": Key(0, COUNT), "lora_alpha": Key(16, POSITIVE, (int, float)),
            "target_modules": Key("all-linear", kinds=(str, [str])), "exclude_modules": null((str, [str])),
            "use_liger": False, "use_fused_kernels": False, "trust_remote_code": False,
        },
        "actor": {
            "strategy": "fsdp2", "ppo_mini_batch_size": Key(256, SIZE), "ppo_micro_batch_size": null(int, SIZE),
            "ppo_micro_batch_size_per_gpu": null(int, SIZE), "use_dynamic_bsz": False,
            "ppo_max_token_len_per_gpu": Key(16384, SIZE), "clip_ratio": Key(0.2, UNIT),
            "clip_ratio_low": null(float, UNIT), "clip_ratio_high": null(float, COUNT),
            "clip_ratio_c": Key(3.0, "(1, inf)"),
            "policy_loss": {"loss_mode": "vanilla", "clip_cov_ratio": Key(2e-4, POSITIVE),
                            "clip_cov_lb": Key(1.0, "(-inf, inf)"), "clip_cov_ub": Key(5.0, "(-inf, inf)"),
                            "kl_cov_ratio": Key(2e-4, POSITIVE), "ppo_kl_coef": Key(0.1, COUNT)},
            "loss_agg_mode": "token-mean", "entropy_coeff": Key(0.0, "(-inf, inf)"), "use_kl_loss": False,
            "use_torch_compile": True, "kl_loss_coef": Key(0.001, COUNT), "kl_loss_type": "low_var_kl",
            "ppo_epochs": Key(1, SIZE), "shuffle": False, "ulysses_sequence_parallel_size": Key(1, SIZE),
            "grad_clip": Key(1.0, POSITIVE), "entropy_from_logits_with_chunking": False,
            "entropy_checkpointing": False, "checkpoint": dict(_CHECKPOINT), "optim": dict(_OPTIM),
            "fsdp_config": dict(_FSDP_CONFIG),
        },
        "ref": {
            "strategy": "fsdp2", "use_torch_compile": null(bool), **_LOG_PROB,
            "ulysses_sequence_parallel_size": null(int, SIZE),
            "fsdp_config": {"wrap_policy": _WRAP_POLICY, "reshard_after_forward": True, **_DTYPES},
        },
        "rollout": {
            "name": "vllm", "mode": "sync", "temperature": Key(1.0, POSITIVE, why=_TEMPERATURE_WHY),
            "top_k": Key(-1, TOP_K, why=_TOP_K_WHY), "top_p": Key(1.0, "(0, 1]"), "do_sample": True, "n": Key(1, SIZE),
            "prompt_length": null(int, SIZE), "response_length": null(int, SIZE), "dtype": "bfloat16",
            "gpu_memory_utilization": Key(0.5, "(0, 1]"), "ignore_eos": False, "enforce_eager": True,
            "free_cache_engine": True, "load_format": "dummy_dtensor", "layered_summon": False,
            "tensor_model_parallel_size": Key(2, SIZE), "max_num_batched_tokens": Key(8192, SIZE),
            "max_model_len": null(int, SIZE), "max_num_seqs": Key(1024, SIZE), "enable_chunked_prefill": True,
            **_LOG_PROB, "disable_log_stats": True, "calculate_log_probs": False,
            "update_weights_bucket_megabytes": Key(512, SIZE),
            "engine_kwargs": {"vllm": free(), "sglang": free()},
            "val_kwargs": {"top_k": Key(-1, TOP_K, why=_TOP_K_WHY), "top_p": Key(1.0, "(0, 1]"),
                           "temperature": Key(0.0, COUNT), "n": Key(1, SIZE), "do_sample": False},
            "multi_turn": {
                "enable": False, "max_assistant_turns": null(int, SIZE), "tool_config_path": null(str),
                "max_user_turns": null(int, SIZE), "max_parallel_calls": Key(1, SIZE),
                "max_tool_response_length": Key(256, SIZE), "tool_response_truncate_side": "middle",
                "interaction_config_path": null(str), "use_inference_chat_template": False,
                "tokenization_sanity_check_mode": "strict", "format": "hermes",
                # an older verl's turn limit, still set by verl's geo3k multi-turn example yaml, which verl's
                # Hydra composition loads without it being a key: it loads here too (verl_keys.NO_EFFECT)
                "max_turns": null(int, SIZE),
            },
        },
    },
    "critic": {
        "rollout_n": null(int, SIZE), "strategy": "fsdp2", "optim": dict(_OPTIM, lr=Key(1e-5, POSITIVE)),
        "model": {"path": null(str), "tokenizer_path": null(str), "override_config": free(),
                  "enable_gradient_checkpointing": True, "use_remove_padding": False, "trust_remote_code": False,
                  "fsdp_config": dict(_FSDP_CONFIG), "lora_rank": Key(0, COUNT),
                  "lora_alpha": Key(16, POSITIVE, (int, float)), "target_modules": Key("all-linear", kinds=(str, [str]))},
        **{key: null(int, SIZE) for key in ("ppo_mini_batch_size", "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu",
                                            "forward_micro_batch_size", "forward_micro_batch_size_per_gpu",
                                            "forward_max_token_len_per_gpu", "ppo_epochs")},
        "use_dynamic_bsz": null(bool), "ppo_max_token_len_per_gpu": Key(32768, SIZE),
        "ulysses_sequence_parallel_size": Key(1, SIZE), "shuffle": null(bool), "grad_clip": Key(1.0, POSITIVE),
        "cliprange_value": Key(0.5, POSITIVE), "loss_agg_mode": null(str), "checkpoint": dict(_CHECKPOINT),
    },
    "reward_model": {
        "enable": False, "strategy": "fsdp2",
        "model": {"input_tokenizer": null(str), "path": null(str), "use_remove_padding": False,
                  "trust_remote_code": False,
                  "fsdp_config": {"fsdp_size": Key(-1, OFF_OR_SIZE), "wrap_policy": _WRAP_POLICY,
                                  "reshard_after_forward": True}},
        **{key: null(int, SIZE) for key in ("micro_batch_size", "micro_batch_size_per_gpu", "max_length",
                                            "forward_max_token_len_per_gpu")},
        "use_dynamic_bsz": null(bool), "reward_manager": "naive", "launch_reward_fn_async": False,
        "reward_kwargs": free(),        # verl's reward manager arguments (dapo: max_resp_len, overlong_buffer_cfg)
        # DAPO's recipe form of the same buffer (verl_keys.DAPO_RECIPE; config.dapo_reward_arguments)
        "overlong_buffer": {"enable": False, "len": Key(0, COUNT), "penalty_factor": Key(0.0, COUNT), "log": False},
    },
    "custom_reward_function": {"path": null(str), "name": "compute_score"},
    "algorithm": {
        "gamma": Key(1.0, UNIT), "lam": Key(1.0, UNIT), "adv_estimator": "gae", "norm_adv_by_std_in_grpo": True,
        "use_kl_in_reward": False, "kl_penalty": "kl",
        "kl_ctrl": {"type": "fixed", "kl_coef": Key(0.001, COUNT), "horizon": Key(10000, SIZE),
                    "target_kl": Key(0.1, COUNT)},
        # DAPO's dynamic sampling (verl_keys.DAPO_RECIPE; minirl.Trainer.sample_varied_groups)
        "filter_groups": {"enable": False, "metric": null(str), "max_num_gen_batches": Key(0, COUNT)},
        # PF-PPO: the batch resampled by its scores after GAE (minirl.Trainer.pf_ppo_resample)
        "use_pf_ppo": False, "pf_ppo": {"reweight_method": "pow", "weight_pow": Key(2.0, COUNT)},
    },
    "trainer": {
        "balance_batch": True, "total_epochs": Key(30, SIZE), "total_training_steps": null(int, SIZE),
        "project_name": "minirl", "experiment_name": "demo",
        "logger": Key(["console"], kinds=(str, [str])), "log_val_generations": Key(0, COUNT),
        "rollout_data_dir": null(str), "validation_data_dir": null(str), "nnodes": Key(1, SIZE),
        "n_gpus_per_node": null(int, SIZE), "save_freq": Key(-1, OFF_OR_COUNT), "resume_mode": "auto",
        "resume_from_path": null(str), "val_before_train": True, "val_only": False,
        "test_freq": Key(-1, OFF_OR_COUNT), "critic_warmup": Key(0, COUNT), "default_hdfs_dir": null(str),
        "del_local_ckpt_after_load": False, "default_local_dir": null(str),
        "max_actor_ckpt_to_keep": null(int, SIZE), "max_critic_ckpt_to_keep": null(int, SIZE),
        "device": "auto", "seed": Key(1, SEED), "hdfs_cache_dir": null(str),
    },
    # one-step-off-policy's separate rollout pool (verl's top-level `rollout:` section)
    "rollout": {"nnodes": Key(1, SIZE), "n_gpus_per_node": null(int, SIZE)},
}

CHOICES = {
    "data.truncation": TRUNCATION_MODES,
    "actor_rollout_ref.actor.loss_agg_mode": LOSS_AGG_MODES,
    "actor_rollout_ref.actor.policy_loss.loss_mode": POLICY_LOSS_MODES,
    "actor_rollout_ref.actor.kl_loss_type": KL_PENALTY_KINDS,
    "actor_rollout_ref.actor.strategy": ("fsdp", "fsdp2"),
    "actor_rollout_ref.actor.optim.warmup_style": ("constant", "cosine"),
    "actor_rollout_ref.rollout.name": ("hf", "vllm"),
    "actor_rollout_ref.rollout.mode": ("sync", "async"),
    # SGLang's parser names for the same <tool_call>{json}</tool_call> format (verl's sglang example yamls use qwen)
    "actor_rollout_ref.rollout.multi_turn.format": ("hermes", "qwen", "qwen25"),
    "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side": ("left", "right", "middle"),
    "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode": ("strict", "ignore_strippable", "disable"),
    "algorithm.adv_estimator": tuple(ADVANTAGE_ESTIMATORS),
    "algorithm.kl_penalty": KL_PENALTY_KINDS,
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "algorithm.pf_ppo.reweight_method": PF_PPO_METHODS,
    "trainer.resume_mode": ("auto", "disable", "resume_path"),
    "trainer.device": ("auto", "cpu", "cuda", "npu"),
    "reward_model.reward_manager": ("naive", "dapo", "batch", "prime"),
}
LOGGERS = ("console", "tensorboard", "wandb")

# The refusals, in one place: keys that load (so verl configs work) but whose other values ask for something
# minirl does not implement. Setting one away from its default is an error naming the feature.
NOT_YET = {
    "rollout.nnodes": (1, "multi-node rollout (minirl runs on one host)"),
    # verl features minirl does not have
    "data.sampler.class_path": (None, "a custom (curriculum) sampler"),
    # another dataset class reads other rows: training on minirl's own instead would be silently wrong
    "data.custom_cls.path": (None, "a custom dataset class (minirl reads parquet rows with verl's columns: data.py)"),
    "data.datagen.path": (None, "a data generator that adds rows during training (verl's DynamicGenDataset)"),
    "reward_model.sandbox_fusion.url": (None, "sandbox-fusion code execution rewards"),
}

SEED_SECTIONS = ("data", "actor_rollout_ref", "critic", "reward_model", "algorithm", "trainer", "rollout",
                 "custom_reward_function", "ray_init")
MAX_CONFIG_BYTES = 1 << 20       # a config file larger than this is refused before it is parsed
MAX_OVERRIDE_CHARS = 1 << 16
MAX_DEPTH = 32                   # nesting levels of yaml mappings/lists accepted (verl's tree has 6)
MAX_VALUES = 100_000             # values in a config once yaml aliases are expanded (verl's tree has ~400)


class ConfigError(ValueError):
    """A config problem, found before any model loads; the message names the key and the fix."""


def get_dotted(tree, dotted, missing=KeyError):
    """tree['a']['b']['c'] for 'a.b.c'; `missing` is returned for an absent key (KeyError: raise)."""
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            if missing is KeyError:
                raise KeyError(dotted)
            return missing
        node = node[part]
    return node


def set_dotted(tree, dotted, value):
    parent, _, last = dotted.rpartition(".")
    (get_dotted(tree, parent) if parent else tree)[last] = value


# ----------------------------------------------------------------------------------------------------------------
# The schema: minirl's table plus verl's remaining keys

def _with_verl_keys(ours, verl, prefix=""):
    """Add verl's keys minirl's table lacks (verl's default, its type); a key verl allows null accepts null."""
    for key, value in verl.items():
        dotted = prefix + key
        if dotted in FREE_FORM:
            ours.setdefault(key, free(copy.deepcopy(value)))
        elif isinstance(value, dict) and not (isinstance(ours.get(key), Key) and ours[key].kinds is dict):
            _with_verl_keys(ours.setdefault(key, {}), value, dotted + ".")
        elif key not in ours:
            ours[key] = Key(value, kinds=dict if isinstance(value, dict) else None)
        elif value is None and isinstance(ours[key], Key):
            ours[key].nullable = True
    return ours


def _as_keys(tree):
    """The table with every leaf a Key of its own (sections share Keys through _OPTIM and _FSDP_CONFIG)."""
    return {k: _as_keys(v) if isinstance(v, dict) else copy.copy(v) if isinstance(v, Key) else Key(v)
            for k, v in tree.items()}


SCHEMA = _with_verl_keys(_as_keys(DEFAULTS), VERL_DEFAULTS)


def leaves(node=SCHEMA, prefix=""):
    """(dotted key, Key) for every leaf of the schema."""
    for key, spec in node.items():
        if isinstance(spec, dict):
            yield from leaves(spec, prefix + key + ".")
        else:
            yield prefix + key, spec


ALL_KEYS = [dotted for dotted, _ in leaves()]


def _is_verl_key(dotted):
    parent, _, last = dotted.rpartition(".")
    node = get_dotted(VERL_DEFAULTS, parent, missing=None) if parent else VERL_DEFAULTS
    return isinstance(node, dict) and last in node


MINIRL_ONLY = [dotted for dotted in ALL_KEYS                                 # left out by --to-verl
               if not _is_verl_key(dotted) and dotted not in DAPO_RECIPE]
