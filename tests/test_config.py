"""Config loading: shapes, merge order, overrides, and every error a user can make, caught before any model loads."""
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from batch_plan import batch_plan
from config import DEFAULTS, ConfigError, dapo_reward_arguments, load_config, settings_without_effect
from conftest import OFFLOAD_SWITCHES

ROOT = Path(__file__).resolve().parents[1]
SEED_KEYS = ROOT / "docs" / "seed-keys.md"  # the seed's key list, one table row per key


@pytest.fixture
def paths(tmp_path):
    """Files the config's path checks accept: a model folder and a train/val parquet placeholder."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    model = tmp_path / "model"
    model.mkdir()
    for name, rows in (("train.parquet", 40), ("test.parquet", 4)):
        pq.write_table(pa.table({"data_source": ["x"] * rows}), tmp_path / name)
    return {"model": str(model), "train": str(tmp_path / "train.parquet"), "val": str(tmp_path / "test.parquet"),
            "dir": tmp_path}


def minimal(paths, **extra):
    """The smallest valid seed-shaped config (GRPO, micro batch set), as a nested dict."""
    tree = {
        "af_output_dir": str(paths["dir"] / "out"),
        "backend_config": {
            "data": {"train_files": paths["train"], "val_files": paths["val"], "train_batch_size": 8},
            "actor_rollout_ref": {
                "model": {"path": paths["model"]},
                "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2},
                "rollout": {"n": 2, "log_prob_micro_batch_size_per_gpu": 4, "tensor_model_parallel_size": 1},
                "ref": {"log_prob_micro_batch_size_per_gpu": 4},
            },
            "algorithm": {"adv_estimator": "grpo"},
        },
    }
    for dotted, value in extra.items():
        node = tree["backend_config"]
        *parents, last = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return tree


def write(paths, tree, name="cfg.yaml"):
    path = paths["dir"] / name
    path.write_text(yaml.safe_dump(tree))
    return path


def test_seed_shape_loads_with_verl_defaults(paths):
    cfg = load_config(write(paths, minimal(paths)), world_size=2)
    assert cfg.data.train_batch_size == 8                                   # from the yaml
    assert cfg.actor_rollout_ref.actor.kl_loss_coef == 0.001                # verl's default
    assert cfg.actor_rollout_ref.actor.clip_ratio_high == 0.2               # derived from clip_ratio
    assert cfg.trainer.default_local_dir == str(paths["dir"] / "out" / "checkpoints")
    assert cfg.actor_rollout_ref.rollout.max_model_len == 512 + 512         # prompt + response


def test_verl_shape_loads_the_same(paths):
    tree = minimal(paths)
    verl_tree = dict(tree["backend_config"], af_output_dir=tree["af_output_dir"])
    a = load_config(write(paths, tree, "a.yaml"), world_size=2)
    b = load_config(write(paths, verl_tree, "b.yaml"), world_size=2)
    assert a == b


def test_merge_order_defaults_yaml_overrides(paths):
    path = write(paths, minimal(paths, actor_rollout_ref__actor__optim={"lr": 3e-6}))
    cfg = load_config(path, ["backend_config.data.train_batch_size=16", "actor_rollout_ref.actor.optim.lr=5e-6"],
                      world_size=2)
    assert cfg.data.train_batch_size == 16                  # seed-style override beats the yaml's 8
    assert cfg.actor_rollout_ref.actor.optim.lr == 5e-6    # verl-style override beats the yaml's 3e-6
    assert cfg.actor_rollout_ref.actor.optim.weight_decay == 0.01   # untouched default


def test_yaml_exponent_without_dot_is_a_float(paths):
    """YAML 1.1 reads `1e-6` as a string; a float key takes it as the number."""
    tree = minimal(paths)
    path = paths["dir"] / "exp.yaml"
    path.write_text(yaml.safe_dump(tree) .replace("backend_config:", "backend_config:\n  critic:\n    optim:\n      lr: 1e-6", 1))
    assert load_config(path, world_size=2).critic.optim.lr == 1e-6


def test_engine_kwargs_accepted_at_seed_and_verl_positions(paths):
    tree = minimal(paths)
    tree["engine_kwargs"] = {"vllm": {"disable_mm_preprocessor_cache": True}}
    tree["backend_config"]["actor_rollout_ref"]["rollout"]["engine_kwargs"] = {"vllm": {"swap_space": 4}}
    cfg = load_config(write(paths, tree), ["engine_kwargs.vllm.max_num_seqs=7"], world_size=2)
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm == {
        "disable_mm_preprocessor_cache": True, "swap_space": 4, "max_num_seqs": 7}


def test_unknown_key_suggests_the_right_one(paths):
    path = write(paths, minimal(paths, data__train_bacth_size=4))
    with pytest.raises(ConfigError, match=r"data\.train_bacth_size.*did you mean 'data\.train_batch_size'"):
        load_config(path, world_size=2)


DAPO_KWARGS = ["reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.max_resp_len=512",
               "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
               "+reward_model.reward_kwargs.overlong_buffer_cfg.len=128",
               "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
               "+reward_model.reward_kwargs.overlong_buffer_cfg.log=false"]


@pytest.mark.parametrize("overrides, message", [
    (["+reward_model.reward_kwargs.max_resp_len=512"], r"has \['max_resp_len'\], but reward_model.reward_manager="
                                                       r"naive takes no arguments"),
    (DAPO_KWARGS[:2], r"reward_manager=dapo needs 'reward_model.reward_kwargs.overlong_buffer_cfg' and "
                      r"'reward_model.reward_kwargs.max_resp_len'.*\+reward_model.reward_kwargs.max_resp_len=16"),
    (["reward_model.overlong_buffer.enable=true"], r"'reward_model.overlong_buffer' is set, but "
                                                   r"reward_model.reward_manager=naive takes no arguments"),
    (DAPO_KWARGS + ["reward_model.overlong_buffer.enable=true"], r"set twice: in 'reward_model.reward_kwargs'.* and "
                                                                 r"in 'reward_model.overlong_buffer' \(DAPO's recipe"),
    (DAPO_KWARGS[:1] + ["reward_model.overlong_buffer.enable=true"], r"'reward_model.overlong_buffer.len'=0 must be "
                                                                     r"at least 1"),
    (["reward_model.reward_manager=batch"], r"reward_manager=batch calls custom_reward_function with the whole batch "
                                            r".*set custom_reward_function.path"),
    (["reward_model.reward_manager=prime", "+reward_model.reward_kwargs.timeout=5"],
     r"has \['timeout'\], but reward_model.reward_manager=prime takes no arguments"),
    (DAPO_KWARGS[:3], r"'reward_model.reward_kwargs.overlong_buffer_cfg.len' must be int, it is not set"),
    (DAPO_KWARGS + ["+reward_model.reward_kwargs.overlong_buffer_cfg.len=0"], r"\.len'=0 must be at least 1"),
    (DAPO_KWARGS + ["+reward_model.reward_kwargs.overlong_buffer_cfg.log=yes please"], r"\.log' must be bool"),
    (DAPO_KWARGS + ["+reward_model.reward_kwargs.overlong_buffer_cfg.lenght=3"], r"has \['lenght'\]; it takes"),
    (DAPO_KWARGS + ["+reward_model.reward_kwargs.max_resp_length=3"], r"has \['max_resp_length'\]; reward_model"),
    (DAPO_KWARGS + ["+reward_model.reward_kwargs.max_resp_len=0"], r"max_resp_len'=0 must be at least 1"),
    (DAPO_KWARGS + ["+reward_model.reward_kwargs.max_resp_len=true"], r"max_resp_len' must be int, got True"),
])
def test_reward_manager_arguments_are_checked_before_loading(paths, overrides, message):
    """verl's load_reward_manager hands reward_model.reward_kwargs to the manager: naive takes none, dapo needs
    max_resp_len and overlong_buffer_cfg {enable, len, penalty_factor, log} (DAPO's scripts add them with +)."""
    with pytest.raises(ConfigError, match=message):
        load_config(write(paths, minimal(paths)), ["data.max_response_length=16", *overrides], world_size=2)
    cfg = load_config(write(paths, minimal(paths)), DAPO_KWARGS, world_size=2)
    assert cfg.reward_model.reward_kwargs["overlong_buffer_cfg"]["len"] == 128
    # with the buffer off verl reads nothing else of it: DAPO's scripts then pass len=0 and penalty_factor=0.0
    off = DAPO_KWARGS[:2] + ["+reward_model.reward_kwargs.overlong_buffer_cfg.enable=false",
                             "+reward_model.reward_kwargs.overlong_buffer_cfg.len=0"]
    assert not load_config(write(paths, minimal(paths)), off, world_size=2).reward_model.reward_kwargs[
        "overlong_buffer_cfg"]["enable"]
    # batch: reward_kwargs are the custom function's own keyword arguments, anything
    reward = paths["dir"] / "reward.py"
    reward.write_text("def compute_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):\n"
                      "    return [0.0] * len(solution_strs)\n")
    batch = ["reward_model.reward_manager=batch", f"custom_reward_function.path={reward}",
             "+reward_model.reward_kwargs.judge.url=http://localhost:1"]
    assert load_config(write(paths, minimal(paths)), batch, world_size=2).reward_model.reward_kwargs == {
        "judge": {"url": "http://localhost:1"}}
    with pytest.raises(ConfigError, match=r"'reward_model.overlong_buffer' is set, but the overlong buffer belongs"):
        load_config(write(paths, minimal(paths)), batch + ["reward_model.overlong_buffer.enable=true"], world_size=2)
    # DAPO's recipe form (main_dapo): reward_model.overlong_buffer, the response length as max_resp_len; off unless set
    recipe = ["data.max_response_length=16", "reward_model.reward_manager=dapo"]
    assert dapo_reward_arguments(load_config(write(paths, minimal(paths)), recipe, world_size=2))[0] == {
        "max_resp_len": 16, "overlong_buffer_cfg": {"enable": False, "len": 0, "penalty_factor": 0.0, "log": False}}
    recipe += ["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=4",
               "reward_model.overlong_buffer.penalty_factor=0.5"]
    assert dapo_reward_arguments(load_config(write(paths, minimal(paths)), recipe, world_size=2))[0] == {
        "max_resp_len": 16, "overlong_buffer_cfg": {"enable": True, "len": 4, "penalty_factor": 0.5, "log": False}}


DYNAMIC = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"]


@pytest.mark.parametrize("overrides, message", [
    (["data.gen_batch_size=24"], r"'data.gen_batch_size'=24 differs from 'data.train_batch_size'=8, which only "
                                 r"dynamic sampling uses: set algorithm.filter_groups.enable=true"),
    (DYNAMIC[:1], r"filter_groups.enable=true needs 'algorithm.filter_groups.metric'.*seq_reward, seq_final_reward"),
    (DYNAMIC + ["algorithm.use_kl_in_reward=true"], r"with 'algorithm.use_kl_in_reward'=true.*use_kl_loss instead"),
    (DYNAMIC + ["rollout.n_gpus_per_node=1", "trainer.n_gpus_per_node=1"], r"not supported on split devices"),
    (DYNAMIC + ["data.gen_batch_size=3", "actor_rollout_ref.rollout.n=1", "data.train_batch_size=4",
                "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"],
     r"data.gen_batch_size \* rollout.n = 3\*1 = 3 responses must be divisible by the world size 2"),
    (DYNAMIC + ["algorithm.filter_groups.max_num_gen_batches=-1"], r"max_num_gen_batches"),
])
def test_dynamic_sampling_settings_are_checked_before_loading(paths, overrides, message):
    """DAPO's recipe keys (data.gen_batch_size, algorithm.filter_groups.*): each inconsistent setting is named."""
    with pytest.raises(ConfigError, match=message):
        load_config(write(paths, minimal(paths)), overrides, world_size=2)
    cfg = load_config(write(paths, minimal(paths)), DYNAMIC + ["data.gen_batch_size=24"], world_size=2)
    assert (cfg.data.gen_batch_size, cfg.algorithm.filter_groups.max_num_gen_batches) == (24, 0)   # the recipe's
    assert load_config(write(paths, minimal(paths)), ["data.gen_batch_size=8"], world_size=2).data.gen_batch_size == 8


def test_grpo_passk_needs_two_responses_a_prompt(paths):
    """Found by fuzzing: with rollout.n=1 the plan passed and the advantage raised at step 1, after the models had
    loaded. grpo, rloo, opo and gpg take n=1 (the advantage falls back as verl's does)."""
    n1 = ["actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]
    with pytest.raises(ConfigError, match=r"adv_estimator=grpo_passk .* needs 'actor_rollout_ref.rollout.n' >= 2 "
                                          r"\(got 1\)"):
        load_config(write(paths, minimal(paths)), n1 + ["algorithm.adv_estimator=grpo_passk"], world_size=2)
    load_config(write(paths, minimal(paths)), n1 + ["algorithm.adv_estimator=rloo"], world_size=2)
    load_config(write(paths, minimal(paths)), ["algorithm.adv_estimator=grpo_passk"], world_size=2)


def test_a_hub_id_as_model_path_says_how_to_get_a_local_copy(paths):
    """verl's example scripts pass actor_rollout_ref.model.path=Qwen/..., which verl downloads; minirl reads local
    or hdfs:// folders, and says so with the download command. A missing path that is no hub id gets no hint."""
    path = write(paths, minimal(paths))
    with pytest.raises(ConfigError, match=r"path 'Qwen/Qwen2\.5-3B-Instruct' does not exist; it reads as a Hugging "
                                          r"Face Hub id.*`hf download Qwen/Qwen2\.5-3B-Instruct --local-dir "
                                          r"~/models/Qwen2\.5-3B-Instruct`"):
        load_config(path, ["actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct"], world_size=2)
    with pytest.raises(ConfigError, match=r"path '/no/such/model' does not exist$"):
        load_config(path, ["actor_rollout_ref.model.path=/no/such/model"], world_size=2)


def test_key_in_the_wrong_section_points_to_the_right_one(paths):
    with pytest.raises(ConfigError, match=r"data\.ppo_epochs.*actor_rollout_ref\.actor\.ppo_epochs"):
        load_config(write(paths, minimal(paths)), ["data.ppo_epochs=2"], world_size=2)


def test_every_unknown_key_of_a_file_is_named_at_once_with_the_likeliest_home(paths):
    """An old verl yaml with several stale keys: one error lists them all, a name that exists in another section
    pointing there before a near spelling among its siblings (data.custom_chat_template is not data.custom_cls)."""
    tree = minimal(paths, data__custom_chat_template="{{ x }}", trainer__totl_epochs=3,
                   reward_model__model__fsdp_config__min_num_params=0,
                   custom_reward_function__overlong_buffer={"enable": True})      # a section of another section's
    with pytest.raises(ConfigError) as caught:
        load_config(write(paths, tree), world_size=2)
    assert str(caught.value) == (
        f"4 unknown config keys (from {paths['dir'] / 'cfg.yaml'}):\n"
        "  'custom_reward_function.overlong_buffer': did you mean 'reward_model.overlong_buffer'?\n"
        "  'data.custom_chat_template': did you mean 'actor_rollout_ref.model.custom_chat_template'?\n"
        "  'reward_model.model.fsdp_config.min_num_params': did you mean "
        "'actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params' or "
        "'actor_rollout_ref.ref.fsdp_config.wrap_policy.min_num_params' or "
        "'critic.model.fsdp_config.wrap_policy.min_num_params'?\n"
        "  'trainer.totl_epochs': did you mean 'trainer.total_epochs'?")


def test_unknown_override_key(paths):
    with pytest.raises(ConfigError, match="unknown config key 'trainer.totl_epochs'.*total_epochs"):
        load_config(write(paths, minimal(paths)), ["trainer.totl_epochs=3"], world_size=2)
    # nothing near it: a key of a newer verl or of a recipe (the one-step-off-policy recipe's yaml has this one)
    with pytest.raises(ConfigError, match=r"'trainer.weight_sync_with_ray' .*: not a key of verl v0\.5\.0's"):
        load_config(write(paths, minimal(paths)), ["trainer.weight_sync_with_ray=true"], world_size=2)
    # several overrides' unknown keys in one error (an old script has several), an old verl key with its successor
    with pytest.raises(ConfigError) as caught:
        load_config(write(paths, minimal(paths)), ["trainer.totl_epochs=3", "data.train_batch_size=8",
                                                   "actor_rollout_ref.actor.use_token_level_loss=true"], world_size=2)
    assert str(caught.value) == (
        "2 unknown config keys (from 3 command-line overrides):\n"
        "  'trainer.totl_epochs': did you mean 'trainer.total_epochs'?\n"
        "  'actor_rollout_ref.actor.use_token_level_loss': it became 'actor_rollout_ref.actor.loss_agg_mode' "
        "(token-mean for true, seq-mean-token-mean for false)")


@pytest.mark.parametrize("override, pattern", [
    ("data.train_batch_size=abc", r"'data.train_batch_size' must be int, got 'abc'"),
    ("actor_rollout_ref.actor.use_kl_loss=3", r"'actor_rollout_ref.actor.use_kl_loss' must be bool"),
    ("actor_rollout_ref.actor.optim.lr=[1]", r"'actor_rollout_ref.actor.optim.lr' must be float"),
    ("critic.ppo_micro_batch_size_per_gpu=two", r"'critic.ppo_micro_batch_size_per_gpu' must be int, got 'two'"),
    ("reward_model.micro_batch_size_per_gpu=1.5", r"'reward_model.micro_batch_size_per_gpu' must be int"),
    # Python's spelling of none is yaml's text: the error says how to write it (only where null is allowed)
    ("trainer.total_training_steps=None", r"must be int, got 'None' \(str; yaml writes none as null\)"),
    ("data.train_batch_size=None", r"'data.train_batch_size' must be int, got 'None' \(str\); default"),
])
def test_wrong_type(paths, override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(write(paths, minimal(paths)), [override], world_size=2)


@pytest.mark.parametrize("override, key", [
    ("actor_rollout_ref.actor.kl_loss_type=low_var", "actor_rollout_ref.actor.kl_loss_type"),
    ("actor_rollout_ref.actor.loss_agg_mode=token_mean", "actor_rollout_ref.actor.loss_agg_mode"),
    ("data.truncation=cut", "data.truncation"),
    ("trainer.resume_mode=latest", "trainer.resume_mode"),
    ("actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.name"),
    ("algorithm.adv_estimator=grpoo", "algorithm.adv_estimator"),
])
def test_invalid_choice_names_key_and_choices(paths, override, key):
    with pytest.raises(ConfigError, match=rf"'{key}' is .*choose one of"):
        load_config(write(paths, minimal(paths)), [override], world_size=2)


def test_invalid_choice_suggests_closest(paths):
    with pytest.raises(ConfigError, match="did you mean 'token-mean'"):
        load_config(write(paths, minimal(paths)), ["actor_rollout_ref.actor.loss_agg_mode=token_mean"], world_size=2)


def test_unknown_logger(paths):
    with pytest.raises(ConfigError, match=r"trainer.logger.*\['mlflow'\].*console, tensorboard, wandb"):
        load_config(write(paths, minimal(paths)), ["trainer.logger=[console,mlflow]"], world_size=2)
    # a comma without brackets is one name (Hydra would take it for a sweep): the error shows the list's spelling
    with pytest.raises(ConfigError, match=re.escape("['console,wandb'] (a list is written in brackets: "
                                                    "trainer.logger=[console,wandb])")):
        load_config(write(paths, minimal(paths)), ["trainer.logger=console,wandb"], world_size=2)


def test_responses_must_divide_by_world_size(paths):
    # 8 prompts x n=3 = 24 responses: fine for 2 ranks, not for 5... use 3 prompts x 3 = 9 on 2 ranks
    with pytest.raises(ConfigError, match=r"3\*3 = 9 responses must be divisible by the world size 2"):
        load_config(write(paths, minimal(paths)), ["data.train_batch_size=3", "actor_rollout_ref.rollout.n=3",
                                                   "actor_rollout_ref.actor.ppo_mini_batch_size=3"], world_size=2)


def test_micro_batch_must_divide_mini_batch(paths):
    # mini per rank = 4 prompts * 2 / 2 ranks = 4 responses; micro 3 does not divide it
    with pytest.raises(ConfigError, match=r"4\*2/2 = 4 responses.*ppo_micro_batch_size_per_gpu'=3"):
        load_config(write(paths, minimal(paths)), ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"],
                    world_size=2)


def test_train_batch_must_be_at_least_mini_batch(paths):
    with pytest.raises(ConfigError, match=r"'data.train_batch_size'=2 must be >= .*ppo_mini_batch_size'=4"):
        load_config(write(paths, minimal(paths)), ["data.train_batch_size=2"], world_size=2)


def test_missing_micro_batch_without_dynamic_bsz(paths):
    with pytest.raises(ConfigError, match="ppo_micro_batch_size_per_gpu"):
        load_config(write(paths, minimal(paths)), ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null"],
                    world_size=2)


def test_a_deprecated_global_micro_batch_beside_its_per_gpu_key_names_both_values(paths):
    """A verl script's ppo_micro_batch_size on top of a file that sets ppo_micro_batch_size_per_gpu (the minimal
    config here, config.yaml for a user): the error says which values met and what to null."""
    with pytest.raises(ConfigError, match=r"'actor_rollout_ref\.actor\.ppo_micro_batch_size_per_gpu' \(=2\) and "
                                          r"the deprecated 'actor_rollout_ref\.actor\.ppo_micro_batch_size' \(=4\): "
                                          r"set the other to null"):
        load_config(write(paths, minimal(paths)), ["actor_rollout_ref.actor.ppo_micro_batch_size=4"], world_size=2)


def test_the_critics_deprecated_global_micro_batches_are_split_over_the_ranks(paths):
    """verl's deprecated critic.ppo_micro_batch_size and forward_micro_batch_size are global: over 2 ranks, 4 and 8
    are 2 and 4 rows a rank in the update and in the value pass (the update crashed on it: it read only the
    _per_gpu key)."""
    from models import MiniBatchPlan
    critic = [f"critic.model.path={paths['model']}", "algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size=4"]
    cfg = load_config(write(paths, minimal(paths)), critic, world_size=2)
    assert MiniBatchPlan.of(cfg.critic, cfg.critic.rollout_n, dp_size=2).micro_batch_rows == 2
    assert batch_plan(cfg, 2)["critic_forward_micro_batch"] == 2            # verl: forward defaults to the update's
    cfg = load_config(write(paths, minimal(paths)), critic + ["critic.forward_micro_batch_size=8"], world_size=2)
    assert batch_plan(cfg, 2)["critic_forward_micro_batch"] == 4


@pytest.mark.parametrize("kl", [[], ["actor_rollout_ref.actor.use_kl_loss=true"],
                                ["algorithm.use_kl_in_reward=true"]])
def test_the_references_micro_batch_is_required_only_where_a_reference_is_built(paths, kl):
    """verl's PPO examples without a KL term leave the reference's log-prob micro-batch unset: no reference model
    is built then, so nothing asks for it."""
    unset = ["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=null"]
    if not kl:
        load_config(write(paths, minimal(paths)), unset, world_size=2)
        return
    with pytest.raises(ConfigError, match=r"set 'actor_rollout_ref\.ref\.log_prob_micro_batch_size_per_gpu'"):
        load_config(write(paths, minimal(paths)), unset + kl, world_size=2)


def test_tp_must_divide_world(paths):
    with pytest.raises(ConfigError, match="tensor_model_parallel_size'=2 does not divide the world size 3"):
        load_config(write(paths, minimal(paths)), ["actor_rollout_ref.rollout.name=vllm",
                                                   "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                                                   "data.train_batch_size=12", "actor_rollout_ref.rollout.n=1",
                                                   "actor_rollout_ref.actor.ppo_mini_batch_size=6"], world_size=3)


@pytest.mark.parametrize("override, pattern", [
    ("actor_rollout_ref.model.path=/no/such/model", "actor_rollout_ref.model.path': path '/no/such/model'"),
    ("data.train_files=[/no/a.parquet]", "data.train_files': path '/no/a.parquet'"),
    ("custom_reward_function.path=/no/reward.py", "custom_reward_function.path': path '/no/reward.py'"),
])
def test_paths_that_do_not_exist(paths, override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(write(paths, minimal(paths)), [override], world_size=2)


def test_hdfs_paths_are_not_checked_locally(paths):
    cfg = load_config(write(paths, minimal(paths)), ["data.train_files=hdfs://nn/data/train.parquet"], world_size=2)
    assert cfg.data.train_files == "hdfs://nn/data/train.parquet"


def test_gae_needs_a_critic(paths):
    with pytest.raises(ConfigError, match="critic.model.path"):
        load_config(write(paths, minimal(paths)), ["algorithm.adv_estimator=gae"], world_size=2)


def test_features_not_built_yet_are_refused_clearly(paths):
    with pytest.raises(ConfigError, match="rollout.nnodes' enables multi-node rollout .*, which minirl does not "
                                          "implement yet"):
        load_config(write(paths, minimal(paths)), ["rollout.nnodes=2"], world_size=2)


def test_batch_plan_arithmetic(paths):
    cfg = load_config(write(paths, minimal(paths)), world_size=2)
    plan = batch_plan(cfg, 2)
    # 8 prompts x n=2 = 16 responses; 8 per rank; mini = 4 prompts -> 2 mini-batches of 4*2/2 = 4 per rank;
    # micro 2 -> 2 micro-batches per mini-batch; 1 epoch x 2 mini-batches = 2 optimizer steps
    assert (plan["responses_per_step"], plan["responses_per_rank"]) == (16, 8)
    assert (plan["mini_batches_per_step"], plan["responses_per_mini_batch_per_rank"]) == (2, 4)
    assert plan["micro_batches_per_mini_batch"] == 2
    assert plan["optimizer_steps_per_step"] == 2


def test_config_yaml_holds_every_seed_key():
    """Every key of the seed's parameter table is in config.yaml, at the seed's position."""
    keys = [line.split("|")[1].strip() for line in SEED_KEYS.read_text().splitlines() if line.startswith("| ")][1:]
    assert len(keys) == len(set(keys)) == 50                         # [1:] drops the header row
    tree = yaml.safe_load((ROOT / "config.yaml").read_text())
    for key in keys:
        node = tree
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"config.yaml lacks seed key {key}"
            node = node[part]


def test_every_default_key_is_known_to_the_schema():
    """config.yaml loads through the schema without an unknown key (checked without the path checks)."""
    cfg = load_config(ROOT / "config.yaml", world_size=2, check_paths=False)
    assert cfg.actor_rollout_ref.rollout.n == 8 and set(cfg) >= set(DEFAULTS)


def test_print_config_cli(paths):
    out = subprocess.run([sys.executable, str(ROOT / "minirl.py"), "--config", str(write(paths, minimal(paths))),
                          "--print-config", "--world-size", "2"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "responses per step 16 (train_batch_size x n), per rank 8" in out.stdout
    assert "optimizer steps per training step 2" in out.stdout
    # 40 rows / 8 prompts = 5 steps per epoch x 30 epochs (verl's default total_epochs)
    assert "training steps 150, optimizer steps in total 300" in out.stdout
    assert "train_batch_size: 8" in out.stdout
    # 40 rows and a batch of 64 prompts: no step at all (it said "training steps 0", while a run stops)
    out = subprocess.run([sys.executable, str(ROOT / "minirl.py"), "--config", str(write(paths, minimal(paths))),
                          "--print-config", "--world-size", "2", "data.train_batch_size=64"],
                         capture_output=True, text=True, cwd=ROOT)
    assert "no training step: data.train_files hold 40 rows, fewer than one batch of 64 prompts" in out.stdout
    assert "training steps" not in out.stdout


@pytest.mark.parametrize("script", ["minirl.py", "data.py"])
def test_help_opens_with_the_whole_first_paragraph_of_the_docstring(script):
    """Not its first line, which ends mid-sentence."""
    out = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    source = (ROOT / script).read_text()
    first_paragraph = source[source.index('"""') + 3:].split("\n\n")[0]
    assert " ".join(first_paragraph.split()) in " ".join(out.stdout.split())


def test_print_config_names_the_keys_without_effect(paths):
    """--print-config is where a verl user checks a config before a run; it names verl's keys that change nothing
    here as the run would (found passing verl's LoRA line with layered_summon: the run warned, the check did not)."""
    out = subprocess.run([sys.executable, str(ROOT / "minirl.py"), "--config", str(write(paths, minimal(paths))),
                          "--print-config", "--world-size", "2", "actor_rollout_ref.rollout.layered_summon=True"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert ("warning: config key 'actor_rollout_ref.rollout.layered_summon'=True has no effect in minirl: weights "
            "are gathered in buckets of update_weights_bucket_megabytes") in out.stderr


def test_cli_reports_config_error_before_loading_models(paths):
    out = subprocess.run([sys.executable, str(ROOT / "minirl.py"), "--config", str(write(paths, minimal(paths))),
                          "data.train_bacth_size=4"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2
    assert "did you mean 'data.train_batch_size'" in out.stderr


def test_verl_keys_without_effect_are_named_in_a_warning(paths):
    assert settings_without_effect(load_config(write(paths, minimal(paths)), world_size=2)) == []
    read = "actor_rollout_ref.ref.fsdp_config.reshard_after_forward"   # minirl reads it; the rest of fsdp_config not
    cfg = load_config(write(paths, minimal(paths)), ["data.dataloader_num_workers=4", f"{read}=false",
                                                     "actor_rollout_ref.actor.fsdp_config.forward_prefetch=true"],
                      world_size=2)
    assert cfg.actor_rollout_ref.ref.fsdp_config.reshard_after_forward is False
    warnings = settings_without_effect(cfg)
    assert len(warnings) == 2
    assert warnings[0].startswith("config key 'data.dataloader_num_workers'=4 has no effect in minirl")
    assert "'actor_rollout_ref.actor.fsdp_config.forward_prefetch'=True" in warnings[1]
    # verl's offload switches (its examples set them) are read, for every worker; FSDP2's offload policy says what
    # happens instead, not the subtree's general reason
    cfg = load_config(write(paths, minimal(paths)), OFFLOAD_SWITCHES + ["critic.model.fsdp_config.offload_policy=true"],
                      world_size=2)
    assert cfg.actor_rollout_ref.actor.fsdp_config.optimizer_offload is True
    assert settings_without_effect(cfg) == [
        "config key 'critic.model.fsdp_config.offload_policy'=True has no effect in minirl: FSDP2's CPUOffloadPolicy "
        "is not used; param_offload and optimizer_offload keep the model and optimizer state in host memory between "
        "phases"]
    # the agent loop's yamls while multi-turn rollouts are off: not read (verl does not read them either)
    yamls = [f"actor_rollout_ref.rollout.multi_turn.{key}_config_path=x.yaml" for key in ("tool", "interaction")]
    assert settings_without_effect(load_config(write(paths, minimal(paths)), yamls, world_size=2)) == [
        f"config key 'actor_rollout_ref.rollout.multi_turn.{key}_config_path' is set but multi-turn rollouts are off, "
        f"so it is not used: set actor_rollout_ref.rollout.multi_turn.enable=True" for key in ("tool", "interaction")]
    # dynamic sampling's settings while it is off (found: they were silently ignored, as verl ignores them)
    cfg = load_config(write(paths, minimal(paths)), ["algorithm.filter_groups.metric=acc",
                                                     "algorithm.filter_groups.max_num_gen_batches=10"], world_size=2)
    assert settings_without_effect(cfg) == [
        f"config key 'algorithm.filter_groups.{key}'={value} is set but dynamic sampling is off, so it is not used: "
        f"set algorithm.filter_groups.enable=true" for key, value in (("metric", "'acc'"), ("max_num_gen_batches", 10))]
    # a multi-turn switch of verl's SGLang rollout, which re-templates the conversation for training
    cfg = load_config(write(paths, minimal(paths)), ["actor_rollout_ref.rollout.multi_turn.use_inference_chat_template"
                                                     "=true"], world_size=2)
    assert settings_without_effect(cfg) == [
        "config key 'actor_rollout_ref.rollout.multi_turn.use_inference_chat_template'=True has no effect in minirl: "
        "the tokens trained are those the model read while generating (earlier turns are never re-templated)"]


def test_fsdp_size_groups_must_divide_the_training_ranks(paths):
    key = "actor_rollout_ref.actor.fsdp_config.fsdp_size"
    cfg = load_config(write(paths, minimal(paths)), [f"{key}=2"], world_size=4)
    assert cfg.actor_rollout_ref.actor.fsdp_config.fsdp_size == 2
    assert settings_without_effect(cfg) == []                          # read (models.fsdp_mesh), no warning
    load_config(write(paths, minimal(paths)), [f"{key}=8"], world_size=4)     # >= the world: all ranks, as verl
    models_built = ["algorithm.adv_estimator=gae", f"critic.model.path={paths['model']}", "reward_model.enable=true",
                    f"reward_model.model.path={paths['model']}"]
    for dotted in (key, "critic.model.fsdp_config.fsdp_size", "reward_model.model.fsdp_config.fsdp_size"):
        with pytest.raises(ConfigError, match=rf"'{dotted}'=3 does not divide the 4 training ranks: .* choose a "
                                              r"divisor of 4, or -1 to shard over all ranks"):
            load_config(write(paths, minimal(paths)), [f"{dotted}=3"] + models_built, world_size=4)


def test_settings_of_a_model_that_is_not_built_are_named_as_unused(paths):
    """GRPO builds no critic and, unless enabled, no reward model: their sizes are neither checked nor silent."""
    unused = ["critic.model.lora_rank=8", "critic.model.fsdp_config.fsdp_size=3",
              "reward_model.model.fsdp_config.fsdp_size=3"]
    cfg = load_config(write(paths, minimal(paths)), unused, world_size=4)        # 3 divides nothing built
    assert settings_without_effect(cfg) == [
        "config key 'critic.model.lora_rank'=8 is set but no critic is built with algorithm.adv_estimator=grpo (it "
        "trains with algorithm.adv_estimator=gae), so it is not used",
        "config key 'critic.model.fsdp_config.fsdp_size'=3 is set but no critic is built with "
        "algorithm.adv_estimator=grpo (it trains with algorithm.adv_estimator=gae), so it is not used",
        "config key 'reward_model.model.fsdp_config.fsdp_size'=3 is set but no reward model is built (set "
        "reward_model.enable=true to score with one), so it is not used"]
    built = ["algorithm.adv_estimator=gae", f"critic.model.path={paths['model']}", "reward_model.enable=true",
             f"reward_model.model.path={paths['model']}", "critic.model.lora_rank=8",
             "critic.model.fsdp_config.fsdp_size=2", "reward_model.model.fsdp_config.fsdp_size=2",
             "critic.ppo_micro_batch_size_per_gpu=1", "reward_model.micro_batch_size_per_gpu=1"]
    assert settings_without_effect(load_config(write(paths, minimal(paths)), built, world_size=4)) == []


def test_nodes_must_multiply_to_the_world_size(paths):
    cfg = load_config(write(paths, minimal(paths)), ["trainer.nnodes=2", "trainer.n_gpus_per_node=1"], world_size=2)
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (2, 1)
    with pytest.raises(ConfigError, match=r"'trainer.nnodes' x 'trainer.n_gpus_per_node' = 2 x 2 but 2 processes"):
        load_config(write(paths, minimal(paths)), ["trainer.nnodes=2", "trainer.n_gpus_per_node=2"], world_size=2)
    with pytest.raises(ConfigError, match=r"3 processes cannot be spread evenly over 'trainer.nnodes'=2"):
        load_config(write(paths, minimal(paths)), ["trainer.nnodes=2", "data.train_batch_size=6",
                                                   "actor_rollout_ref.actor.ppo_mini_batch_size=3",
                                                   "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"],
                    world_size=3)


def test_vllm_tensor_parallel_group_stays_inside_a_node(paths):
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size'=2 does not fit in one node of 1 processes"):
        load_config(write(paths, minimal(paths)), ["trainer.nnodes=2", "actor_rollout_ref.rollout.name=vllm",
                                                   "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
                    world_size=2)


# ----------------------------------------------------------------------------------------------------------------
# Coming from verl, going to verl

# (verl v0.5.0's own trainer config, loaded unchanged: tests/test_verl_config.py)


def test_world_size_for_planning(paths, monkeypatch):
    from config import planning_world_size
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_config(write(paths, minimal(paths)))
    assert planning_world_size(cfg) == (1, "neither --world-size nor trainer.n_gpus_per_node is set")
    assert planning_world_size(cfg, 4) == (4, "--world-size")
    cfg = load_config(write(paths, minimal(paths)), ["trainer.n_gpus_per_node=2"])
    assert planning_world_size(cfg)[0] == 2
    assert planning_world_size(cfg, 6)[0] == 6                     # --world-size still overrides


def test_verl_keys_that_change_the_algorithm_are_refused(paths):
    for override, feature in (("data.sampler.class_path=my.py", "sampler"), ("data.custom_cls.path=ds.py", "dataset"),
                              ("data.datagen.path=gen.py", "data generator"),
                              ("reward_model.sandbox_fusion.url=http://x", "sandbox")):
        with pytest.raises(ConfigError, match=rf"'{override.split('=')[0]}' enables .*{feature}"):
            load_config(write(paths, minimal(paths)), [override], world_size=2)


def test_greedy_decoding_of_a_group_is_named_as_learning_nothing(paths):
    """do_sample=false with n > 1: every response of a group is the same, so a group estimator's advantages are all
    zero (temperature=0, the same thing, is refused; do_sample is verl's key and loads, with this warning)."""
    cfg = load_config(write(paths, minimal(paths)), ["actor_rollout_ref.rollout.do_sample=false"], world_size=2)
    assert settings_without_effect(cfg) == [
        "config key 'actor_rollout_ref.rollout.do_sample'=false decodes greedily, so the n=2 responses to a prompt "
        "are identical and grpo's advantages, relative to the group, are all zero: nothing is learned; set "
        "do_sample=true (verl's default)"]
    cfg = load_config(write(paths, minimal(paths)), ["actor_rollout_ref.rollout.do_sample=false",
                                                     "actor_rollout_ref.rollout.n=1", "data.train_batch_size=4",
                                                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"],
                      world_size=2)
    assert settings_without_effect(cfg) == []


@pytest.mark.parametrize("overrides, warning", [
    (["actor_rollout_ref.rollout.val_kwargs.n=4"],
     "config key 'actor_rollout_ref.rollout.val_kwargs.n'=4 repeats a greedy validation: the 4 responses to a prompt "
     "are identical; set actor_rollout_ref.rollout.val_kwargs.do_sample=true and a temperature to sample them"),
    (["actor_rollout_ref.rollout.val_kwargs.do_sample=true"],
     "config key 'actor_rollout_ref.rollout.val_kwargs.do_sample'=true has no effect at "
     "actor_rollout_ref.rollout.val_kwargs.temperature=0: validation decodes greedily; set "
     "actor_rollout_ref.rollout.val_kwargs.temperature (e.g. 1.0) to sample"),
    (["actor_rollout_ref.rollout.val_kwargs.do_sample=true", "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
      "actor_rollout_ref.rollout.val_kwargs.n=4"], None),
])
def test_a_greedy_validation_that_was_asked_to_sample_or_repeat_is_named(paths, overrides, warning):
    """Found by fuzzing: val_kwargs.n=4 decoded greedily ran 4 identical generations, and do_sample=true at the
    default val temperature 0 was greedy, both without a word."""
    cfg = load_config(write(paths, minimal(paths)), overrides, world_size=2)
    assert settings_without_effect(cfg) == ([warning] if warning else [])


def test_pf_ppo_settings_are_checked_and_named_where_they_do_nothing(paths):
    cfg = load_config(write(paths, minimal(paths)), ["algorithm.pf_ppo.reweight_method=max_min",
                                                     "algorithm.pf_ppo.weight_pow=1.0"], world_size=2)
    assert settings_without_effect(cfg) == [
        f"config key 'algorithm.pf_ppo.{key}'={value} is set but PF-PPO is off, so it is not used: set "
        f"algorithm.use_pf_ppo=true" for key, value in (("reweight_method", "'max_min'"), ("weight_pow", 1.0))]
    # verl resamples after GAE only: with another estimator the switch does nothing there either
    cfg = load_config(write(paths, minimal(paths)), ["algorithm.use_pf_ppo=true"], world_size=2)
    assert settings_without_effect(cfg) == [
        "config key 'algorithm.use_pf_ppo'=true has no effect with algorithm.adv_estimator=grpo: PF-PPO resamples the "
        "batch after GAE only (as verl); use algorithm.adv_estimator=gae with a critic"]
    with pytest.raises(ConfigError, match=r"'algorithm.pf_ppo.reweight_method' is 'maxmin' \(did you mean 'max_min'\?\); choose one of: pow"):
        load_config(write(paths, minimal(paths)), ["algorithm.pf_ppo.reweight_method=maxmin"])
    with pytest.raises(ConfigError, match=r"'algorithm.pf_ppo.weight_pow'"):
        load_config(write(paths, minimal(paths)), ["algorithm.pf_ppo.weight_pow=-1"])


def test_policy_loss_modes_are_verls_and_their_options_checked(paths):
    kl_cov = ["actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov",
              "actor_rollout_ref.actor.policy_loss.ppo_kl_coef=1.0"]
    cfg = load_config(write(paths, minimal(paths)), kl_cov, world_size=2)
    assert dict(cfg.actor_rollout_ref.actor.policy_loss) == {
        "loss_mode": "kl_cov", "clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "kl_cov_ratio": 2e-4,
        "ppo_kl_coef": 1.0}                                                             # verl's defaults besides
    with pytest.raises(ConfigError, match=r"'actor_rollout_ref.actor.policy_loss.loss_mode'.*gspo"):
        load_config(write(paths, minimal(paths)), ["actor_rollout_ref.actor.policy_loss.loss_mode=gpsO"])
    with pytest.raises(ConfigError, match=r"'actor_rollout_ref.actor.policy_loss.clip_cov_ratio'"):
        load_config(write(paths, minimal(paths)), ["actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0"])


def test_verl_keys_without_effect_warn_only_away_from_verls_default(paths):
    cfg = load_config(write(paths, minimal(paths)), ["ray_init.num_cpus=4", "trainer.profile_steps=[1,2]",
                                                     "data.dataloader_num_workers=8", "algorithm._target_=x.Y"],
                      world_size=2)
    warnings = settings_without_effect(cfg)
    assert [w.split("'")[1] for w in warnings] == ["trainer.profile_steps", "ray_init"]   # 8 is verl's default
    assert "no Ray" in warnings[1]


def test_null_where_verl_allows_null(paths):
    cfg = load_config(write(paths, minimal(paths)), ["critic.optim.min_lr_ratio=null", "trainer.profile_steps=null",
                                                     "reward_model.sandbox_fusion.url=null"], world_size=2)
    assert cfg.critic.optim.min_lr_ratio == 0.0          # verl's critic null: no floor under the cosine schedule
    for key in ("lr", "min_lr_ratio"):      # verl's actor optimizer allows no null (its critic's min_lr_ratio does)
        with pytest.raises(ConfigError, match=f"'actor_rollout_ref.actor.optim.{key}' must be float, got None"):
            load_config(write(paths, minimal(paths)), [f"actor_rollout_ref.actor.optim.{key}=null"], world_size=2)


def test_verl_command_line_forms(paths):
    """Through a real shell, as users type them: key=value, +key=value, key='["a","b"]', key=[a,b], True/true and
    the logger as a plain string."""
    script = (f"{shlex.quote(sys.executable)} -c 'import sys, json; sys.path.insert(0, \".\"); from config import "
              f"load_config; cfg = load_config(sys.argv[1], sys.argv[2:], world_size=2); print(json.dumps(cfg))' "
              f"{shlex.quote(str(write(paths, minimal(paths))))} "
              "+trainer.seed=7 actor_rollout_ref.actor.checkpoint.save_contents='[\"model\",\"optimizer\"]' "
              "actor_rollout_ref.actor.checkpoint.load_contents=[model,optimizer] "
              "actor_rollout_ref.actor.use_kl_loss=True data.shuffle=false trainer.val_only=False "
              "trainer.logger=console backend_config.trainer.project_name=p")
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)
    assert cfg["trainer"]["seed"] == 7
    assert cfg["actor_rollout_ref"]["actor"]["checkpoint"] == {"save_contents": ["model", "optimizer"],
                                                                "load_contents": ["model", "optimizer"]}
    assert cfg["actor_rollout_ref"]["actor"]["use_kl_loss"] is True
    assert (cfg["data"]["shuffle"], cfg["trainer"]["val_only"]) == (False, False)
    assert cfg["trainer"]["logger"] == ["console"]
    assert cfg["trainer"]["project_name"] == "p"


def _parse_verl_line(text, module="verl.trainer.main_ppo"):
    """The overrides of `python3 -m <module> ...` and of the comment listing minirl-only settings."""
    command, comment = text.split("\n# ", 1)
    words = shlex.split(command.replace("\\\n", " "))
    assert words[:3] == ["python3", "-m", module]
    listed = comment.split("left out: ", 1)[1].strip()
    return words[3:], [] if listed == "none" else shlex.split(listed)


def test_to_verl_round_trips_through_minirls_loader(paths):
    tree = minimal(paths, actor_rollout_ref__actor__optim={"lr": 3e-6, "betas": [0.8, 0.99]},
                   trainer={"logger": ["console", "tensorboard"], "project_name": "my run", "n_gpus_per_node": 2,
                            "seed": 5},
                   actor_rollout_ref__rollout__engine_kwargs={"vllm": {"swap_space": 4, "enable_prefix_caching": True}},
                   ray_init={"num_cpus": 3})
    path = write(paths, tree)
    out = subprocess.run([sys.executable, str(ROOT / "minirl.py"), "--config", str(path), "--to-verl"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr
    verl_args, minirl_only = _parse_verl_line(out.stdout)
    assert "actor_rollout_ref.actor.optim.lr=3.0e-06" in verl_args
    assert "ray_init.num_cpus=3" in verl_args and "trainer.n_gpus_per_node=2" in verl_args
    assert "+actor_rollout_ref.rollout.engine_kwargs.vllm.enable_prefix_caching=true" in verl_args  # not in verl's tree
    assert "actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4" in verl_args
    assert 'trainer.project_name="my run"' in verl_args
    assert "+actor_rollout_ref.actor.optim.betas=[0.8, 0.99]" in verl_args    # verl reads it undeclared
    assert not any(arg.split("=")[0] in ("af_output_dir", "trainer.seed") for arg in verl_args)
    assert {item.split("=")[0] for item in minirl_only} == {"af_output_dir", "trainer.seed"}
    original = load_config(path, world_size=2)
    assert load_config(None, verl_args + minirl_only, world_size=2) == original


def test_to_verl_writes_a_run_with_dynamic_sampling_for_dapos_recipe(paths):
    """verl's main_ppo has no dynamic sampling: the line runs DAPO's recipe, whose yaml declares its keys (no '+'),
    and loads back to the same config; without it the recipe's keys (at no effect) are listed as left out."""
    path = write(paths, minimal(paths))
    dapo = DYNAMIC + ["data.gen_batch_size=24", "algorithm.filter_groups.max_num_gen_batches=10",
                      "reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=true",
                      "reward_model.overlong_buffer.len=128", "reward_model.overlong_buffer.penalty_factor=1.0"]
    out = subprocess.run([sys.executable, str(ROOT / "minirl.py"), "--config", str(path), "--to-verl", *dapo],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr
    verl_args, minirl_only = _parse_verl_line(out.stdout, "recipe.dapo.main_dapo")
    assert {"data.gen_batch_size=24", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
            "algorithm.filter_groups.max_num_gen_batches=10", "reward_model.overlong_buffer.enable=true",
            "reward_model.overlong_buffer.len=128", "reward_model.overlong_buffer.penalty_factor=1.0"} <= set(verl_args)
    assert not any("reward_kwargs" in arg for arg in verl_args)                 # main_dapo does not read them
    assert load_config(None, verl_args + minirl_only, world_size=2) == load_config(path, dapo, world_size=2)
    out = subprocess.run([sys.executable, str(ROOT / "minirl.py"), "--config", str(path), "--to-verl",
                          "algorithm.filter_groups.metric=acc"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    verl_args, minirl_only = _parse_verl_line(out.stdout)
    assert "algorithm.filter_groups.metric=acc" in minirl_only and not any("filter_groups" in a for a in verl_args)
    # main_ppo reads the DAPO manager's arguments from reward_kwargs: the recipe form is written that way
    out = subprocess.run([sys.executable, str(ROOT / "minirl.py"), "--config", str(path), "--to-verl", *dapo[4:]],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    verl_args, _ = _parse_verl_line(out.stdout)
    assert ("+reward_model.reward_kwargs={max_resp_len: 512, overlong_buffer_cfg: {enable: true, len: 128, "
            "penalty_factor: 1.0, log: false}}") in verl_args and not any("overlong_buffer." in a for a in verl_args)


def test_to_verl_says_where_verl_runs_interactions(paths):
    """An interaction run's line loads back to the same config, with a note that verl v0.5.0 runs interactions in its
    SGLang rollout only (minirl's rollout.name is kept: minirl has no SGLang engine to load the line back with)."""
    (paths["dir"] / "interaction.yaml").write_text(
        "interaction:\n  - name: gsm8k\n    class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction\n")
    path = write(paths, minimal(paths))
    multi_turn = ["actor_rollout_ref.rollout.multi_turn.enable=true", "data.return_raw_chat=true",
                  f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={paths['dir']}/interaction.yaml"]
    out = subprocess.run([sys.executable, str(ROOT / "minirl.py"), "--config", str(path), "--to-verl", *multi_turn],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "\n# verl v0.5.0 runs interactions in its SGLang rollout only (actor_rollout_ref.rollout.name=sglang)" \
        in out.stdout
    verl_args, minirl_only = _parse_verl_line(out.stdout)
    assert load_config(None, verl_args + minirl_only, world_size=2) == load_config(path, multi_turn, world_size=2)
    plain = subprocess.run([sys.executable, str(ROOT / "minirl.py"), "--config", str(path), "--to-verl"],
                           capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert "SGLang" not in plain.stdout
