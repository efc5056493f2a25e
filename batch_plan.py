"""The step's batch arithmetic (verl v0.5.0's normalisation in verl/workers/fsdp_workers.py,
ActorRolloutRefWorker.__init__ and CriticWorker.__init__): check_batch raises a ConfigError naming the keys where
the sizes do not divide for a world size, batch_plan computes responses per rank, mini- and micro-batches.
"""
import os

from config_keys import ConfigError, get_dotted


def _check_micro(per_gpu, global_size, dp, dotted):
    if per_gpu is not None and global_size is not None:
        raise ConfigError(f"set only one of '{dotted}_per_gpu' (={per_gpu}) and the deprecated '{dotted}' "
                          f"(={global_size}): set the other to null (a config file, such as minirl's config.yaml, "
                          f"may have set it)")
    if per_gpu is None and global_size is not None and global_size % dp:
        raise ConfigError(f"'{dotted}'={global_size} must be divisible by the {dp} data-parallel ranks; "
                          f"prefer '{dotted}_per_gpu'")


def micro_per_gpu(per_gpu, global_size, dp):
    """A micro-batch per rank: the `_per_gpu` key, else verl's deprecated global key split over the dp ranks."""
    return global_size // dp if per_gpu is None and global_size is not None else per_gpu


def _data_parallel(cfg, world_size, sp_key="actor_rollout_ref.actor.ulysses_sequence_parallel_size"):
    """A worker's data-parallel size: world / its ulysses_sequence_parallel_size (verl's dp with sp); the actor's
    by default."""
    sp = get_dotted(cfg, sp_key)
    if world_size % sp:
        raise ConfigError(f"'{sp_key}'={sp} must divide the world size {world_size} (groups of sp consecutive "
                          f"ranks share one data-parallel share of the batch)")
    return world_size // sp


def needs_reference(cfg):
    """verl builds the reference policy only for a KL term: in the loss (actor.use_kl_loss) or in the reward
    (algorithm.use_kl_in_reward); main_ppo.py adds the RefPolicy role for exactly these."""
    return bool(cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)


REF_SP, CRITIC_SP = "actor_rollout_ref.ref.ulysses_sequence_parallel_size", "critic.ulysses_sequence_parallel_size"


# each FSDP-sharded model's fsdp_size (the reference shares the actor's, as in verl)
FSDP_SIZE_KEY = {"actor": "actor_rollout_ref.actor.fsdp_config.fsdp_size",
                 "critic": "critic.model.fsdp_config.fsdp_size",
                 "reward_model": "reward_model.model.fsdp_config.fsdp_size"}


def fsdp_group_size(fsdp_size, world_size):
    """Over how many ranks a model is sharded (verl's create_device_mesh): groups of fsdp_size (HSDP, the copies
    replicated across the groups), or all ranks for -1 or a size of the world or more."""
    return fsdp_size if 0 < fsdp_size < world_size else world_size


def _check_fsdp_sizes(cfg, world_size):
    """An fsdp_size under the (training) world size forms groups of that many ranks (models.fsdp_mesh): it must
    divide the world size. A model that is not built (no critic without GAE, no reward model unless enabled) is not
    checked: config.settings_without_effect names its setting instead."""
    built = {"critic": cfg.algorithm.adv_estimator == "gae", "reward_model": cfg.reward_model.enable}
    for role, dotted in FSDP_SIZE_KEY.items():
        if not built.get(role, True):
            continue
        size = get_dotted(cfg, dotted)
        if world_size % fsdp_group_size(size, world_size):
            raise ConfigError(f"'{dotted}'={size} does not divide the {world_size} training ranks: each model is "
                              f"sharded over groups of fsdp_size ranks and replicated across the groups; choose a "
                              f"divisor of {world_size}, or -1 to shard over all ranks")


def check_batch(cfg, world_size):
    """Raise ConfigError where the step's batch arithmetic for `world_size` ranks does not divide. With split
    devices (rollout.n_gpus_per_node) `world_size` is all processes and the arithmetic is over the trainer ranks."""
    data, arr = cfg.data, cfg.actor_rollout_ref
    actor, rollout, ref = arr.actor, arr.rollout, arr.ref
    n = rollout.n
    if cfg.rollout.n_gpus_per_node:
        world_size = check_split(cfg, world_size)
    dp, ref_dp = _data_parallel(cfg, world_size), _data_parallel(cfg, world_size, REF_SP)
    if not cfg.rollout.n_gpus_per_node:
        if rollout.name == "vllm" and world_size % rollout.tensor_model_parallel_size:
            raise ConfigError(f"'actor_rollout_ref.rollout.tensor_model_parallel_size'="
                              f"{rollout.tensor_model_parallel_size} does not divide the world size {world_size}")
        _check_nodes(cfg, world_size)
    _check_fsdp_sizes(cfg, world_size)
    responses = data.train_batch_size * n
    if responses % world_size:
        raise ConfigError(f"data.train_batch_size * rollout.n = {data.train_batch_size}*{n} = {responses} responses "
                          f"must be divisible by the world size {world_size}; change 'data.train_batch_size'")
    if (generation_batch_size(cfg) * n) % world_size:
        raise ConfigError(f"data.gen_batch_size * rollout.n = {data.gen_batch_size}*{n} = {data.gen_batch_size * n} "
                          f"responses must be divisible by the world size {world_size}; change 'data.gen_batch_size'")
    if data.train_batch_size < actor.ppo_mini_batch_size:
        raise ConfigError(f"'data.train_batch_size'={data.train_batch_size} must be >= "
                          f"'actor_rollout_ref.actor.ppo_mini_batch_size'={actor.ppo_mini_batch_size}")
    if data.train_batch_size % actor.ppo_mini_batch_size:
        raise ConfigError(f"'data.train_batch_size'={data.train_batch_size} must be a multiple of "
                          f"'actor_rollout_ref.actor.ppo_mini_batch_size'={actor.ppo_mini_batch_size}")
    if (actor.ppo_mini_batch_size * n) % dp:
        raise ConfigError(f"ppo_mini_batch_size * rollout.n = {actor.ppo_mini_batch_size * n} responses must be "
                          f"divisible by the {dp} data-parallel ranks")
    mini_per_rank = actor.ppo_mini_batch_size * n // dp
    _check_micro(actor.ppo_micro_batch_size_per_gpu, actor.ppo_micro_batch_size, dp,
                 "actor_rollout_ref.actor.ppo_micro_batch_size")
    micro = micro_per_gpu(actor.ppo_micro_batch_size_per_gpu, actor.ppo_micro_batch_size, dp)
    if not actor.use_dynamic_bsz:
        if micro is None:
            raise ConfigError("set 'actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu' "
                              "(or use_dynamic_bsz=true with ppo_max_token_len_per_gpu)")
        if micro <= 0 or mini_per_rank % micro:
            raise ConfigError(f"the mini-batch per rank is ppo_mini_batch_size*n/dp = "
                              f"{actor.ppo_mini_batch_size}*{n}/{dp} = {mini_per_rank} responses, which "
                              f"'actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu'={micro} must divide")
    max_len = data.max_prompt_length + data.max_response_length
    sp = world_size // dp
    if actor.use_dynamic_bsz and actor.ppo_max_token_len_per_gpu * sp < max_len:   # the budget covers sp devices
        raise ConfigError(f"'actor_rollout_ref.actor.ppo_max_token_len_per_gpu'={actor.ppo_max_token_len_per_gpu} "
                          f"(x ulysses_sequence_parallel_size {sp}) must be at least "
                          f"max_prompt_length + max_response_length = {max_len}")
    log_prob_workers = [(rollout, "actor_rollout_ref.rollout", dp)]
    if needs_reference(cfg):                 # verl checks the reference's sizes only where it builds one
        log_prob_workers.append((ref, "actor_rollout_ref.ref", ref_dp))
    for worker, prefix, worker_dp in log_prob_workers:
        _check_micro(worker.log_prob_micro_batch_size_per_gpu, worker.log_prob_micro_batch_size, worker_dp,
                     prefix + ".log_prob_micro_batch_size")
        size = micro_per_gpu(worker.log_prob_micro_batch_size_per_gpu, worker.log_prob_micro_batch_size, worker_dp)
        if size is None and not worker.log_prob_use_dynamic_bsz:
            raise ConfigError(f"set '{prefix}.log_prob_micro_batch_size_per_gpu' (or log_prob_use_dynamic_bsz)")
    if cfg.algorithm.adv_estimator == "gae":
        _check_critic_batch(cfg, _data_parallel(cfg, world_size, CRITIC_SP))
    if cfg.reward_model.enable:        # the reward model runs without sequence parallelism: dp = world size
        rm = cfg.reward_model
        _check_micro(rm.micro_batch_size_per_gpu, rm.micro_batch_size, world_size, "reward_model.micro_batch_size")
        if (micro_per_gpu(rm.micro_batch_size_per_gpu, rm.micro_batch_size, world_size) is None
                and not rm.use_dynamic_bsz):
            raise ConfigError("set 'reward_model.micro_batch_size_per_gpu' (or reward_model.use_dynamic_bsz)")


def _check_nodes(cfg, world_size):
    """trainer.nnodes x trainer.n_gpus_per_node processes (torchrun's --nnodes x --nproc_per_node), and vLLM's
    tensor-parallel groups (consecutive ranks) inside one node."""
    nnodes, per_node, tp = cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, cfg.actor_rollout_ref.rollout
    if per_node is not None and nnodes * per_node != world_size:
        raise ConfigError(f"'trainer.nnodes' x 'trainer.n_gpus_per_node' = {nnodes} x {per_node} but {world_size} "
                          f"processes were started; set them to torchrun's --nnodes and --nproc_per_node (or "
                          f"n_gpus_per_node=null: torchrun decides)")
    if world_size % nnodes:
        raise ConfigError(f"{world_size} processes cannot be spread evenly over 'trainer.nnodes'={nnodes} nodes")
    node_size = per_node or world_size // nnodes
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and int(local) != node_size:
        raise ConfigError(f"torchrun started {local} processes on this node, but trainer.nnodes={nnodes} over "
                          f"{world_size} processes means {node_size} per node; set 'trainer.nnodes' to torchrun's "
                          f"--nnodes")
    if tp.name == "vllm" and node_size % tp.tensor_model_parallel_size:
        raise ConfigError(f"'actor_rollout_ref.rollout.tensor_model_parallel_size'={tp.tensor_model_parallel_size} "
                          f"does not fit in one node of {node_size} processes; a vLLM tensor-parallel group must "
                          f"stay inside a node")


# one-step-off-policy (offpolicy.py) supports the estimators verl's recipe does (GPG aside: minirl lacks it)
SPLIT_ESTIMATORS = ("grpo", "grpo_passk", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo")


def check_split(cfg, world_size):
    """Split devices: the first T of `world_size` processes train, the last R = rollout.n_gpus_per_node generate.
    Raise ConfigError for an impossible split; return T."""
    rollout, r, t_key = cfg.actor_rollout_ref.rollout, cfg.rollout.n_gpus_per_node, cfg.trainer.n_gpus_per_node
    trainers = world_size - r if t_key is None else t_key
    if cfg.trainer.nnodes != 1:
        raise ConfigError(f"'trainer.nnodes'={cfg.trainer.nnodes}: split devices run on one host; set it to 1")
    if trainers < 1 or trainers + r != world_size:
        raise ConfigError(f"'trainer.n_gpus_per_node'={t_key} + 'rollout.n_gpus_per_node'={r} must equal the "
                          f"{world_size} processes started (torchrun --nproc_per_node); the first ones train, the "
                          f"last 'rollout.n_gpus_per_node' generate")
    if rollout.name == "vllm" and r % rollout.tensor_model_parallel_size:
        raise ConfigError(f"'actor_rollout_ref.rollout.tensor_model_parallel_size'="
                          f"{rollout.tensor_model_parallel_size} must divide 'rollout.n_gpus_per_node'={r} (vLLM's "
                          f"tensor-parallel groups live inside the rollout ranks)")
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and int(local) != world_size:
        raise ConfigError(f"split devices run on one host, but torchrun started {local} of the {world_size} "
                          f"processes here")
    return trainers


def check_split_keys(cfg):
    """The split's settings that need no world size: hybrid_engine=false asks for a split, and the estimator."""
    if not cfg.rollout.n_gpus_per_node:
        if not cfg.actor_rollout_ref.hybrid_engine:
            raise ConfigError("'actor_rollout_ref.hybrid_engine'=false asks for one-step-off-policy on split "
                              "devices: set 'rollout.n_gpus_per_node' to the number of rollout ranks")
        return
    if cfg.algorithm.adv_estimator not in SPLIT_ESTIMATORS:
        raise ConfigError(f"'algorithm.adv_estimator'={cfg.algorithm.adv_estimator} is not supported on split "
                          f"devices (one-step-off-policy supports {', '.join(SPLIT_ESTIMATORS)}); choose one of "
                          f"them or unset 'rollout.n_gpus_per_node' (colocated)")


def _check_critic_batch(cfg, dp):
    """The critic's own mini/micro batches: ppo_mini_batch_size prompts x critic.rollout_n responses."""
    critic = cfg.critic
    mini = critic.ppo_mini_batch_size * critic.rollout_n
    if mini % dp:
        raise ConfigError(f"critic.ppo_mini_batch_size * rollout.n = {mini} responses must be divisible by the "
                          f"{dp} data-parallel ranks")
    if cfg.data.train_batch_size % critic.ppo_mini_batch_size:
        raise ConfigError(f"'data.train_batch_size'={cfg.data.train_batch_size} must be a multiple of "
                          f"'critic.ppo_mini_batch_size'={critic.ppo_mini_batch_size}")
    _check_micro(critic.ppo_micro_batch_size_per_gpu, critic.ppo_micro_batch_size, dp, "critic.ppo_micro_batch_size")
    micro = micro_per_gpu(critic.ppo_micro_batch_size_per_gpu, critic.ppo_micro_batch_size, dp)
    if not critic.use_dynamic_bsz and (micro is None or micro <= 0 or (mini // dp) % micro):
        raise ConfigError(f"the critic's mini-batch per rank is {mini // dp} responses; set "
                          f"'critic.ppo_micro_batch_size_per_gpu' to a divisor of it (or critic.use_dynamic_bsz)")


def batch_plan(cfg, world_size):
    """The step's batch arithmetic for `world_size` ranks (after check_batch)."""
    check_batch(cfg, world_size)
    split = {}
    if cfg.rollout.n_gpus_per_node:
        trainers = check_split(cfg, world_size)
        split = {"trainer_ranks": trainers, "rollout_ranks": world_size - trainers}
        world_size = trainers
    data, arr = cfg.data, cfg.actor_rollout_ref
    actor, rollout, ref = arr.actor, arr.rollout, arr.ref
    dp, ref_dp, n = _data_parallel(cfg, world_size), _data_parallel(cfg, world_size, REF_SP), rollout.n
    responses = data.train_batch_size * n
    mini_per_rank = actor.ppo_mini_batch_size * n // dp
    micro = micro_per_gpu(actor.ppo_micro_batch_size_per_gpu, actor.ppo_micro_batch_size, dp)
    mini_batches = data.train_batch_size // actor.ppo_mini_batch_size
    plan = {
        "world_size": world_size, **split, "dp": dp, "sp": world_size // dp, "responses_per_step": responses,
        "responses_per_rank": responses // dp, "mini_batches_per_step": mini_batches,
        "responses_per_mini_batch_per_rank": mini_per_rank,
        "micro_batch_per_rank": "dynamic" if actor.use_dynamic_bsz else micro,
        "micro_batches_per_mini_batch": "dynamic" if actor.use_dynamic_bsz else mini_per_rank // micro,
        "optimizer_steps_per_step": actor.ppo_epochs * mini_batches,
        "old_log_prob_micro_batch": micro_per_gpu(rollout.log_prob_micro_batch_size_per_gpu,
                                                  rollout.log_prob_micro_batch_size, dp),
        "ref_log_prob_micro_batch": micro_per_gpu(ref.log_prob_micro_batch_size_per_gpu,
                                                  ref.log_prob_micro_batch_size, ref_dp),
    }
    if cfg.algorithm.filter_groups.enable:
        plan.update(generation_batch=generation_batch_size(cfg), n=n)
    if cfg.algorithm.adv_estimator == "gae":
        critic, critic_dp = cfg.critic, _data_parallel(cfg, world_size, CRITIC_SP)
        critic_micro = micro_per_gpu(critic.ppo_micro_batch_size_per_gpu, critic.ppo_micro_batch_size, critic_dp)
        plan.update(critic_dp=critic_dp,
                    critic_responses_per_mini_batch_per_rank=critic.ppo_mini_batch_size * critic.rollout_n // critic_dp,
                    critic_micro_batch=critic_micro,
                    critic_forward_micro_batch=(micro_per_gpu(critic.forward_micro_batch_size_per_gpu,
                                                              critic.forward_micro_batch_size, critic_dp)
                                                or critic_micro))
    if cfg.reward_model.enable:
        rm = cfg.reward_model
        plan["reward_model_micro_batch"] = micro_per_gpu(rm.micro_batch_size_per_gpu, rm.micro_batch_size, world_size)
    return plan


def generation_batch_size(cfg):
    """Prompts the loader hands out at a time: data.gen_batch_size (dynamic sampling draws batches of it until
    train_batch_size prompts are kept), else data.train_batch_size."""
    return cfg.data.gen_batch_size or cfg.data.train_batch_size


def total_training_steps(cfg, batches_per_epoch):
    """verl: len(dataloader) * total_epochs, unless trainer.total_training_steps is set."""
    if cfg.trainer.total_training_steps:
        return cfg.trainer.total_training_steps
    return batches_per_epoch * cfg.trainer.total_epochs


def format_plan(plan, steps=None):
    lines = ["batch plan:",
             f"  world size {plan['world_size']} (data-parallel {plan['dp']} x sequence-parallel {plan['sp']})"
             if "trainer_ranks" not in plan else
             f"  split devices (one-step-off-policy): ranks 0..{plan['trainer_ranks'] - 1} train (data-parallel "
             f"{plan['dp']} x sequence-parallel {plan['sp']}), ranks {plan['trainer_ranks']}.."
             f"{plan['trainer_ranks'] + plan['rollout_ranks'] - 1} generate one step ahead",
             f"  responses per step {plan['responses_per_step']} (train_batch_size x n), "
             f"per rank {plan['responses_per_rank']}",
             f"  mini-batches per step {plan['mini_batches_per_step']}, "
             f"{plan['responses_per_mini_batch_per_rank']} responses per rank each",
             f"  micro-batches per mini-batch {plan['micro_batches_per_mini_batch']} "
             f"(micro batch {plan['micro_batch_per_rank']} per rank)",
             f"  optimizer steps per training step {plan['optimizer_steps_per_step']} (ppo_epochs x mini-batches)"]
    if "generation_batch" in plan:
        lines.insert(2, f"  dynamic sampling: batches of {plan['generation_batch']} prompts (data.gen_batch_size) "
                        f"until {plan['responses_per_step'] // plan['n']} prompts' responses differ")
    if steps is not None:
        lines.append(f"  training steps {steps}, optimizer steps in total {steps * plan['optimizer_steps_per_step']}")
    return "\n".join(lines)
