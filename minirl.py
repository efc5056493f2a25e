"""minirl: RL post-training of a Hugging Face LLM on one host: GRPO (and the other critic-free estimators) and
PPO with a learned critic.

One process per device, torch.distributed between them, FSDP2 for the trainable models, verl's config keys:

    torchrun --nproc_per_node 2 minirl.py --config config.yaml [key=value ...]
    python minirl.py --config config.yaml --print-config       # resolved config + batch plan, no training
    python minirl.py --config config.yaml --to-verl            # the same run as a verl command line
    python minirl.py --plot outputs/demo                        # reward curve PNG from metrics.jsonl
    python minirl.py --export CKPT OUT [--merge-adapter]        # checkpoint -> Hugging Face folder (checkpoint.py)

One training step, in verl's order (see `train_step`):
    1. prompts -> repeat each n times (interleaved), one uid per prompt
    2. generate responses with the current weights (rollout.py)
    3. balance sequence lengths across ranks
    4. score them (rule rewards in rewards.py, or a reward model), the score on each response's last token
    5. old log-probs (the policy that sampled), reference log-probs (for KL), the critic's values (PPO)
    6. advantages (losses.py) over the whole batch, after an optional KL penalty on the reward (PF-PPO then
       draws the rows the updates train on by their scores)
    7. PPO updates of the critic and the actor: mini-batches, micro-batches, loss normalised over the global
       mini-batch
With DAPO's dynamic sampling (algorithm.filter_groups) phases 1, 2 and 4 repeat over several batches of prompts until
enough groups' responses score differently (`sample_varied_groups`); the rest of the step is the same.
Devices, processes, seeds and paths live in runtime.py, models and their updates in models.py (the loss itself in
losses.py), generation in rollout.py, rows and who holds them in batch.py, logging and metrics in tracking.py,
checkpoints in checkpoint.py.

Where minirl deliberately differs from verl: the loss of a mini-batch is normalised over the whole mini-batch
(all micro-batches and ranks), so the gradient does not depend on the micro-batch size, dynamic batching or the
world size (verl v0.5.0 normalises per micro-batch; see losses.agg_loss).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

# torchrun's agent, read before the slow imports below: a torchrun killed while this rank is still importing must be
# noticed too (failures.watch_parent); else the rank waits 10 minutes for its store, or joins a later job's
LAUNCHER_PID = os.getppid()

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import yaml
from tqdm import tqdm
from transformers import AutoTokenizer

import agent
import checkpoint
import failures
import flops
import interactions
import lora
import losses
import offpolicy
import ulysses
import vision
from batch import (all_gather_rows, all_reduce_sum, balance_and_shard, batch_size_of, concat, gather_tp_groups,
                   repeat_interleave, rows_of_rank, take, uid_groups)
from batch_plan import batch_plan, format_plan, generation_batch_size, needs_reference, total_training_steps
from config import (ConfigError, config_file_path, dapo_reward_arguments, load_config, multi_turn_on,
                    planning_world_size, settings_without_effect)
from data import PromptLoader, RLHFDataset, check_dataset_sizes, collate
from models import AdapterDisabled, Critic, Policy, RewardModel, check_model_folders
from rewards import (add_overlong_penalty, check_reward_signature, check_rows, load_reward_fn, score_batch,
                     score_in_processes, score_responses, token_level_scores)
from runtime import (check_output_folders, claim_output_folder, init_distributed, pick_device, resolve_paths,
                     sampling_seed, seed_everything, share_cpu)
from rollout import (Sampling, build_rollout, check_model_fits_rollout, pad_logprobs, responses_to_batch,
                     rollout_probs_diff)
from to_verl import to_verl
from tracking import (Tracker, data_metrics, memory_metrics, pick_validation_generations, plot, timing_metrics,
                      validation_metrics)

# ----------------------------------------------------------------------------------------------------------------
# Small pieces of the step


def kl_controller(kl_ctrl):
    """algorithm.kl_ctrl -> the in-reward KL coefficient's controller (losses.py)."""
    if kl_ctrl.type == "fixed":
        return losses.FixedKLController(kl_ctrl.kl_coef)
    return losses.AdaptiveKLController(kl_ctrl.kl_coef, kl_ctrl.target_kl, kl_ctrl.horizon)


@contextmanager
def timer(name, timings):
    start = time.perf_counter()
    yield
    timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


# ----------------------------------------------------------------------------------------------------------------
# The trainer


NONFINITE_STEPS_TO_STOP = 3      # training steps in a row with a skipped (NaN/inf) update that stop the run


class TrainingDiverged(RuntimeError):
    """Too many non-finite updates in a row; the message names the likely causes and the last good checkpoint."""


class TooFewVariedGroups(RuntimeError):
    """Dynamic sampling drew algorithm.filter_groups.max_num_gen_batches batches without filling one step."""


class Trainer:
    """Holds what lives across steps: models, rollout engine, data, reward function, logger."""

    def __init__(self, cfg):
        self.cfg = cfg
        device_type, backend = pick_device(cfg.trainer.device)
        # split devices (offpolicy.py): this process group holds the trainer ranks only; the bridge reaches the
        # rollout ranks (trainer rank 0 only)
        bridge = offpolicy.init_process_groups(cfg, backend) if offpolicy.rollout_ranks(cfg) else None
        self.rank, self.world_size, self.device = init_distributed(device_type, backend)
        self.plan = batch_plan(cfg, self.world_size + offpolicy.rollout_ranks(cfg))
        self.dp = self.plan["dp"]
        seed_everything(cfg.trainer.seed)
        if device_type == "cpu":        # share the cores between the ranks of this node
            share_cpu(int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size)))
        resolve_paths(cfg)
        check_model_folders(cfg)                  # config.json, weights, tokenizer files: named by key, not deep inside
        arr, data = cfg.actor_rollout_ref, cfg.data
        self.tokenizer = AutoTokenizer.from_pretrained(data.tokenizer or arr.model.path,
                                                       trust_remote_code=arr.model.trust_remote_code)
        # a vision-language checkpoint comes with its processor (images -> pixel inputs); None for a text model
        self.processor = processor = vision.load_processor(arr.model.path, arr.model.trust_remote_code)
        use_agent = multi_turn_on(cfg)
        self.tools, self.interactions = agent.load_plugins(cfg)
        dataset_kwargs = dict(max_prompt_length=data.max_prompt_length, truncation=data.truncation,
                              filter_overlong_prompts=data.filter_overlong_prompts, prompt_key=data.prompt_key,
                              image_key=data.image_key, video_key=data.video_key, processor=processor,
                              # a reward model with its own chat template re-templates the raw conversation
                              return_raw_chat=data.return_raw_chat or cfg.reward_model.enable,
                              chat_template=arr.model.custom_chat_template, reward_fn_key=data.reward_fn_key,
                              # the tool schemas go into the chat template (multi-turn)
                              tools=[dict(t.get_openai_tool_schema()) for t in self.tools.values()] or None)
        self.train_set = RLHFDataset(data.train_files, self.tokenizer, **dataset_kwargs)
        self.val_set = RLHFDataset(data.val_files, self.tokenizer, **dataset_kwargs) if data.val_files else None
        for key, dataset in (("data.train_files", self.train_set), ("data.val_files", self.val_set)):
            if dataset is None:
                continue
            dataset.check_prompt_lengths()             # empty prompts, truncation=error: fail before loading
            if dataset.filter_summary() and self.rank == 0:    # verl prints the filtered length too
                print(f"{key}: {dataset.filter_summary()}", flush=True)
        if self.train_set.template_ignores_tools() and self.rank == 0:
            print(f"warning: the chat template does not render the tool schemas, so the prompts do not show the "
                  f"model its tools ({', '.join(self.tools)}); set actor_rollout_ref.model.custom_chat_template to "
                  f"a template that renders `tools`", file=sys.stderr, flush=True)
        check_dataset_sizes(self.train_set, self.val_set, generation_batch_size(cfg))
        self.loader = PromptLoader(self.train_set, generation_batch_size(cfg), shuffle=data.shuffle, seed=data.seed)
        self.total_steps = total_training_steps(cfg, len(self.loader))
        self.reward_fn = load_reward_fn(cfg.custom_reward_function.path, cfg.custom_reward_function.name)
        if cfg.custom_reward_function.path:      # it can take what its reward manager passes: fail before loading
            check_reward_signature(self.reward_fn, cfg.reward_model.reward_manager, cfg.reward_model.reward_kwargs)
        for dataset in filter(None, (self.train_set, self.val_set)):    # every row can be scored: fail before loading
            rows = [(dataset.where(i), row) for i, row in enumerate(dataset.rows)]
            check_rows(None if cfg.reward_model.enable else self.reward_fn, rows, data.reward_fn_key)
            if self.interactions:          # every row's interaction_kwargs names one of the yaml's
                interactions.check_rows(self.interactions, rows, "data file")
            if use_agent:                  # its agent_name is an agent loop minirl runs, its tools_kwargs our tools
                agent.check_agent_names(rows, "data file")
                agent.check_tools_kwargs(rows, self.tools, "data file")
                lacking = agent.missing_tools_kwargs_warning(rows, self.tools, "data file")
                if lacking and self.rank == 0:
                    print(f"warning: {lacking}", file=sys.stderr, flush=True)
        ulysses.check_models(cfg)                     # heads that sp cannot split: from config.json, no weights
        lora.check_models(cfg)                        # LoRA targets that match no layer: likewise
        check_model_fits_rollout(cfg, self.device.type)    # what vLLM would refuse once loaded; hf: a length warning
        check_output_folders(cfg, self.rank)                               # not after the models have loaded
        self.run_lock = claim_output_folder(cfg.af_output_dir) if self.rank == 0 else None   # one run per folder
        checkpoint.check_before_loading(cfg, self.world_size)    # what to save and load; shards need as many ranks
        self.actor = Policy(cfg, self.device, trainable=True, total_steps=self.total_steps)
        # with LoRA the reference is the actor's own base model (adapter disabled): no second copy of the weights
        self.ref = None
        if needs_reference(cfg):
            self.ref = AdapterDisabled(self.actor) if self.actor.lora else Policy(cfg, self.device, trainable=False)
        use_critic = cfg.algorithm.adv_estimator == "gae"
        self.critic = Critic(cfg, self.device, self.total_steps, len(self.tokenizer)) if use_critic else None
        self.reward_model = RewardModel(cfg, self.device, self.tokenizer) if cfg.reward_model.enable else None
        self.kl_ctrl = kl_controller(cfg.algorithm.kl_ctrl) if cfg.algorithm.use_kl_in_reward else None
        # split devices: the rollout ranks generate, one step ahead; the pipeline stands in for the engine here
        self.pipeline = offpolicy.Pipeline(self, bridge, self.seed_of) if offpolicy.rollout_ranks(cfg) else None
        self.rollout = self.pipeline or build_rollout(cfg, self.tokenizer, self.device)
        # multi-turn: the agent loop runs beside the engine (on split devices, on the rollout ranks)
        self.agent = agent.loop_for(cfg, self.tokenizer, self.rollout, self.rank, self.tools, self.interactions) \
            if use_agent and self.pipeline is None else None
        self.peak_flops = flops.peak_flops(flops.device_name(self.device))    # None on CPU: no perf/mfu/actor
        # what checkpoints hold; resuming restores it all, RNG states included
        self.roles = {"actor": self.actor, **({"critic": self.critic} if self.critic else {})}
        self.stateful = {"kl_ctrl": self.kl_ctrl} if self.kl_ctrl else {}
        if self.pipeline is not None:
            self.stateful["offpolicy"] = self.pipeline        # the generated batch a checkpoint takes with it
        self.global_step, saved_row = checkpoint.resume(cfg, self.roles, self.loader, self.stateful)
        self.tracker = Tracker(cfg, enabled=self.rank == 0, start_step=self.global_step, saved_row=saved_row)

    # -- generation, shared by training and validation ------------------------------------------------------
    def generate(self, batch, sampling, seed_purpose):
        """Generate for `batch` (the same full batch on every rank) and return the full rollout batch on every
        rank. The engine's TP groups (tp_size consecutive ranks; 1 rank for hf) split the batch: group g takes the
        g-th contiguous share, all its ranks with the same prompts and seed, and one copy per group is gathered.
        When sampling, the batch also carries rollout_log_probs [B, R] (the engine's log-probs of the sampled
        tokens).
        Split devices: the rollout ranks generate it (offpolicy.Pipeline)."""
        if self.pipeline is not None:
            return self.pipeline.generate(batch, sampling, seed_purpose)
        tp = self.rollout.tp_size
        dp_rank, dp_size = self.rank // tp, self.world_size // tp
        mine = rows_of_rank(batch_size_of(batch), dp_rank, dp_size)
        sync_rollout(self.actor, self.rollout)                                 # the weights move here, every call
        seed = self.seed_of(self.global_step, dp_rank, seed_purpose)
        if self.agent is not None:          # multi-turn: whole conversations, tool tokens masked out (agent.py)
            return {**batch, **self.generate_conversations(take(batch, mine), sampling, seed)}
        multi_modal = vision.rollout_inputs(batch, mine)            # None without images
        tokens, logprobs = self.rollout.generate([batch["raw_prompt_ids"][i] for i in mine], sampling, seed,
                                                 **({"multi_modal": multi_modal} if multi_modal else {}))
        self.rollout.sleep()                                                   # and the memory goes back here
        pad, eos, length = self.tokenizer.pad_token_id, self.rollout.eos_ids, sampling.max_tokens
        local = responses_to_batch(take(batch, mine), tokens, length, pad, eos)
        responses = gather_tp_groups(local["responses"], self.world_size, tp)            # [B, R]
        response_mask = gather_tp_groups(local["response_mask"], self.world_size, tp)    # [B, R]
        lengths = response_mask.sum(-1).tolist()
        full = responses_to_batch(batch, [responses[i, :n].tolist() for i, n in enumerate(lengths)], length, pad, eos)
        if logprobs is not None:
            full["rollout_log_probs"] = gather_tp_groups(pad_logprobs(logprobs, length), self.world_size, tp)  # [B, R]
        return {**batch, **full}

    def seed_of(self, step, dp_rank, purpose):
        return sampling_seed(self.cfg.trainer.seed, step, dp_rank, purpose)

    def generate_conversations(self, local, sampling, seed):
        """This rank's share of rows as conversations -> the full batch's rollout fields on every rank."""
        vllm = self.cfg.actor_rollout_ref.rollout.name == "vllm"
        engine = agent.engine_generate(self.rollout, sampling, batched=vllm)
        multi_modal = vision.rollout_inputs(local, range(batch_size_of(local)))     # None without images
        conversations = self.agent.run(local, engine, seed, multi_modal)
        self.rollout.sleep()
        rows = agent.conversations_to_batch(local, conversations, sampling.max_tokens, self.tokenizer.pad_token_id,
                                            local["extra_info"])
        if sampling.greedy:           # greedy turns come without log-probs (validation; nothing checks them)
            del rows["rollout_log_probs"]
        return agent.gather_rows(rows, self.world_size, self.rollout.tp_size)

    def score(self, batch):
        """(scores [b], extras) of this rank's rows: the reward model's scores when it is enabled (verl's reward
        manager then uses the model score), else the rule (or custom) reward function's. extras[i] holds what a
        reward function returning a dict gave, its "score" too (verl's reward_extra_info; {} otherwise)."""
        if self.reward_model is not None:
            scores = self.reward_model.score(batch, self.plan["reward_model_micro_batch"])
            return scores, [{} for _ in range(len(scores))]
        return self.rule_scores(batch)

    def rule_scores(self, batch):
        """Rule (or custom) rewards for this rank's rows -> (scores [b] (float), extras)."""
        # verl decodes every valid response token: with multi-turn, tool answers included
        valid = batch["attention_mask"][:, -batch["responses"].shape[1]:]
        texts = self.tokenizer.batch_decode([r[m.bool()].tolist() for r, m in zip(batch["responses"], valid)],
                                            skip_special_tokens=True)
        ground_truths = [rm.get("ground_truth") for rm in batch["reward_model"]]
        rows = (texts, batch[self.cfg.data.reward_fn_key], ground_truths, batch["extra_info"], batch["origin"])
        if self.cfg.reward_model.reward_manager == "batch":         # one call for every rank's rows, as verl makes it
            scores, extras = self.score_as_one_batch(rows)
        elif self.cfg.reward_model.reward_manager == "prime":       # in a process pool, failures and timeouts 0.0
            scores, extras = score_in_processes(self.reward_fn, *rows)
        else:
            scores, extras = score_responses(self.reward_fn, *rows)
        if self.cfg.reward_model.reward_manager == "dapo":          # DAPO's overlong penalty on every score
            scores = add_overlong_penalty(scores, extras, valid.sum(-1).tolist(), dapo_reward_arguments(self.cfg)[0])
        return torch.tensor(scores, dtype=torch.float32), extras

    def score_as_one_batch(self, rows):
        """reward_manager=batch: the reward function gets the whole batch in one call, as verl's driver makes it
        (a batched function may score each response against the others): rank 0 calls it on every rank's rows and
        sends each rank its share of the results. rows: this rank's (texts, sources, truths, extra infos, origins)."""
        whole = [all_gather_rows(list(column), self.world_size) for column in rows]
        results = [score_batch(self.reward_fn, *whole, self.cfg.reward_model.reward_kwargs) if self.rank == 0 else None]
        if self.world_size > 1:
            dist.broadcast_object_list(results, src=0)
        scores, extras = results[0]
        mine = rows_of_rank(len(scores), self.rank, self.world_size)
        return [scores[i] for i in mine], [extras[i] for i in mine]

    # -- one training step ----------------------------------------------------------------------------------
    def train_step(self, prompts):
        """One step, in verl's order (the numbered phases below). Who holds which rows: every rank holds the full
        batch, computes on its own rows (`local`, rows `mine` of the rank-major batch: batch.rows_of_rank), then
        gathers the results (batch.all_gather_rows) so every rank holds the full batch again. Generation, rewards
        and the forward passes run on a rank's own rows; advantages run on the full batch (a group may span
        ranks); the updates run on a rank's own rows with the loss normalised over all ranks (losses.agg_loss)."""
        cfg, arr = self.cfg, self.cfg.actor_rollout_ref
        timings, metrics = {}, {}

        with timer("step", timings):
            if self.pipeline is not None:
                # 1-2 (split devices): the rollout ranks repeated and generated this batch one update ago
                batch = self.pipeline.next_batch(timings)
            elif cfg.algorithm.filter_groups.enable:
                # 1, 2 and 4 (DAPO's dynamic sampling): as many batches as it takes to fill this one with groups
                # whose responses score differently; None when the data runs out first
                batch = self.sample_varied_groups(prompts, timings, metrics)
                if batch is None:
                    return None
            else:
                batch = self.generate_responses(prompts, timings, "train")                 # 1 and 2

            # 3. balance: equal-count partitions of near-equal token totals; this rank keeps partition `rank`
            batch, mine, local, seqlen = balance_and_shard(batch, self.rank, self.world_size,
                                                           cfg.trainer.balance_batch, self.actor.shares_prompts)
            metrics.update(seqlen)

            # 4. rewards: the score sits on the last response token (dynamic sampling has scored the rows)
            with timer("reward", timings):
                if "scores" not in batch:
                    local["scores"], local["reward_extras"] = self.score(local)
                    batch["scores"] = all_gather_rows(local["scores"], self.world_size)           # [B]
                valid = batch["attention_mask"][:, -batch["responses"].shape[1]:]                 # [B, R]
                batch["token_level_scores"] = token_level_scores(batch["scores"], valid)          # [B, R]

            # 5. log-probs of the sampling policy (unless the update's own are provably equal), of the reference
            on_policy = update_is_on_policy(cfg, self.global_step)
            if not on_policy:
                with timer("old_log_prob", timings):
                    local["old_log_probs"], entropy = self.actor.compute_log_prob(
                        local, self.plan["old_log_prob_micro_batch"], arr.rollout.log_prob_use_dynamic_bsz,
                        arr.rollout.log_prob_max_token_len_per_gpu, arr.rollout.temperature, calc_entropy=True)
                    metrics.update(self.record_old_log_probs(batch, local, entropy))
            if self.ref is not None:
                with timer("ref", timings):
                    local["ref_log_prob"], _ = self.ref.compute_log_prob(
                        local, self.plan["ref_log_prob_micro_batch"], arr.ref.log_prob_use_dynamic_bsz,
                        arr.ref.log_prob_max_token_len_per_gpu, arr.rollout.temperature)
                    batch["ref_log_prob"] = all_gather_rows(local["ref_log_prob"], self.world_size)    # [B, R]
            if self.critic is not None:
                with timer("values", timings):
                    local["values"] = self.critic.compute_values(local, self.plan["critic_forward_micro_batch"])
                    batch["values"] = all_gather_rows(local["values"], self.world_size)              # [B, R]

            # 6. advantages over the whole batch (groups may span ranks); this rank keeps its rows
            with timer("adv", timings):
                alg = cfg.algorithm
                if self.kl_ctrl is not None:       # KL to the reference as a per-token penalty on the reward
                    batch["token_level_rewards"], kl_metrics = losses.apply_kl_penalty(
                        batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_prob"],
                        batch["response_mask"], self.kl_ctrl, alg.kl_penalty)
                    metrics.update(kl_metrics)
                else:
                    batch["token_level_rewards"] = batch["token_level_scores"]
                batch["advantages"], batch["returns"] = losses.compute_advantages(
                    alg.adv_estimator, token_rewards=batch["token_level_rewards"], mask=batch["response_mask"],
                    group_ids=batch["uid"], values=batch.get("values"), baselines=batch.get("reward_baselines"),
                    gamma=alg.gamma, lam=alg.lam, norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo)
                if alg.use_pf_ppo and alg.adv_estimator == "gae":     # PF-PPO: the updates train on a resample
                    batch, mine, local = self.pf_ppo_resample(batch, local)
                local["advantages"], local["returns"] = batch["advantages"][mine], batch["returns"][mine]

            # 7. PPO updates: the critic, then the actor (after critic_warmup steps, as verl); each is
            #    models.Worker.optimize with losses.critic_loss / losses.actor_loss on every micro-batch
            if self.critic is not None:
                with timer("update_critic", timings):
                    metrics.update(self.critic.update(local, self.plan["critic_dp"]))
            if self.global_step >= cfg.trainer.critic_warmup:
                with timer("update_actor", timings):
                    metrics.update(self.actor.update(local, self.dp, on_policy=on_policy))
                metrics.update(memory_metrics(self.device))     # verl's perf/*memory*_gb, after the update
                if on_policy:                    # the update's first forward gave the sampling policy's log-probs
                    local["old_log_probs"], entropy = self.actor.on_policy_outputs
                    metrics.update(self.record_old_log_probs(batch, local, entropy))
                if self.peak_flops:              # verl's perf/mfu/actor, where the device's peak is known
                    work = arr.actor.ppo_epochs * flops.training_flops(
                        self.actor.model.config, batch["attention_mask"].sum(-1).tolist(),
                        int(batch["response_mask"].sum()))
                    metrics["perf/mfu/actor"] = flops.mfu(work, timings["update_actor"], self.peak_flops,
                                                          self.world_size)

        metrics.update(data_metrics(batch, arr.rollout.response_length))
        if "num_turns" in batch:             # multi-turn conversations
            metrics.update(agent.multi_turn_metrics(batch))
        metrics.update(timing_metrics(timings, batch, self.world_size))
        if cfg.trainer.rollout_data_dir:
            extras = all_gather_rows(local["reward_extras"], self.world_size)    # a collective: every rank takes part
            if self.rank == 0:
                self.dump_generations(cfg.trainer.rollout_data_dir, batch, batch["scores"].tolist(), extras)
        return metrics

    def generate_responses(self, prompts, timings, seed_purpose):
        """Phases 1 and 2 of the step for a batch of prompts -> the rollout batch (B = prompts x n rows)."""
        arr = self.cfg.actor_rollout_ref
        # 1. repeat each prompt n times, interleaved; one uid per prompt
        prompts["uid"] = [str(uuid.UUID(int=random.getrandbits(128))) for _ in range(batch_size_of(prompts))]
        batch = repeat_interleave(prompts, arr.rollout.n)                                  # B = prompts x n

        # 2. generate with the current weights (ReMax also generates greedily, for its baseline)
        with timer("gen", timings):
            prompt_batch, batch = batch, self.generate(batch, Sampling.from_config(arr.rollout), seed_purpose)
        if self.cfg.algorithm.adv_estimator == "remax":
            with timer("gen_max", timings):
                batch["reward_baselines"] = self.greedy_baselines(prompt_batch)            # [B]
        return batch

    def sample_varied_groups(self, prompts, timings, metrics):
        """DAPO's dynamic sampling (algorithm.filter_groups; verl's recipe/dapo/dapo_ray_trainer.py,
        RayDAPOTrainer.fit, v0.5.0). A group whose responses all score alike has zero advantage under GRPO: it
        only dilutes the batch. So: generate and score a batch of data.gen_batch_size prompts, keep the groups
        whose `metric` varies, and draw the loader's next batch until train_batch_size prompts are kept; the step
        trains on the first train_batch_size of them. Returns the batch, its rows scored ("scores" [B],
        "reward_extras"), or None when trainer.total_epochs of data run out first (verl's loop ends there too).
        max_num_gen_batches > 0 stops the run after that many batches without enough groups."""
        cfg, filter_groups = self.cfg, self.cfg.algorithm.filter_groups
        wanted, kept, kept_prompts, gen_batches = cfg.data.train_batch_size, [], 0, 0
        while True:
            gen_batches += 1
            # each generation batch of the step samples with its own seed; the first with the step's usual one
            batch = self.generate_responses(prompts, timings, "train" if gen_batches == 1 else f"train/{gen_batches}")
            with timer("reward", timings):
                mine = rows_of_rank(batch_size_of(batch), self.rank, self.world_size)
                scores, extras = self.score(take(batch, mine))
                batch["scores"] = all_gather_rows(scores, self.world_size)                          # [B]
                batch["reward_extras"] = all_gather_rows(extras, self.world_size)
            groups = varied_groups(batch, filter_groups.metric)
            kept.append(take(batch, [row for group in groups for row in group]))
            kept_prompts += len(groups)
            if kept_prompts >= wanted:
                break
            if 0 < filter_groups.max_num_gen_batches <= gen_batches:
                raise TooFewVariedGroups(
                    f"step {self.global_step}: algorithm.filter_groups.max_num_gen_batches={gen_batches} batches of "
                    f"{self.loader.batch_size} prompts kept {kept_prompts} whose responses' {filter_groups.metric} "
                    f"differ, fewer than data.train_batch_size={wanted}. The data may be too hard or too easy for "
                    f"the model; set algorithm.filter_groups.max_num_gen_batches=0 to keep drawing batches")
            if not self.loader.data_left(cfg.trainer.total_epochs):
                return None
            prompts = self.loader.next_batch()
        metrics["train/num_gen_batches"] = gen_batches
        rows = wanted * cfg.actor_rollout_ref.rollout.n
        return take(concat(kept), list(range(rows)))                      # whole groups: each holds n rows

    def pf_ppo_resample(self, batch, local):
        """PF-PPO (algorithm.use_pf_ppo; verl's compute_advantage after GAE, v0.5.0): the updates train on B rows
        drawn with replacement from the batch, favoured by their scores (losses.pf_ppo_resample), and the step's
        metrics and generation dump describe the drawn rows, as verl's. Every rank draws alike (the generator is
        seeded by the step, so a resumed run draws the same rows too); the drawn rows are balanced over the ranks
        again. Returns (the drawn full batch, this rank's row indices in it, this rank's rows)."""
        if "reward_extras" not in batch:          # gathered first, so that they follow their rows
            batch["reward_extras"] = all_gather_rows(local["reward_extras"], self.world_size)
        pf_ppo = self.cfg.algorithm.pf_ppo
        generator = torch.Generator().manual_seed(self.seed_of(self.global_step, 0, "pf_ppo"))
        drawn = losses.pf_ppo_resample(batch["token_level_scores"].sum(-1).cpu(), pf_ppo.reweight_method,
                                       pf_ppo.weight_pow, generator)                              # [B]
        batch, mine, local, _ = balance_and_shard(take(batch, drawn.tolist()), self.rank, self.world_size,
                                                  self.cfg.trainer.balance_batch, self.actor.shares_prompts)
        return batch, mine, local

    def record_old_log_probs(self, batch, local, entropy):
        """Gather this rank's old log-probs into the full batch; metrics: actor/entropy (over all ranks' response
        tokens) and, with vLLM, its log-probs against the actor's (training/rollout_probs_diff_*)."""
        mask = local["response_mask"].float()
        ent_sum, tok = all_reduce_sum([float((entropy * mask).sum()), float(mask.sum())], self.device)
        metrics = {"actor/entropy": ent_sum / max(tok, 1.0)}
        batch["old_log_probs"] = all_gather_rows(local["old_log_probs"], self.world_size)    # [B, R]
        if "rollout_log_probs" in batch:                 # the engine's log-probs vs the actor's, every step
            metrics.update(rollout_probs_diff(batch["rollout_log_probs"], batch["old_log_probs"],
                                              batch["response_mask"]))
        return metrics

    def dump_generations(self, folder, batch, scores, extras):
        """verl's generation dump: <folder>/<step>.jsonl, one {input, output, score, step} line per response, plus
        what a reward function's dict result holds (verl's reward_extra_info: its "score" replaces the step's, as in
        verl's dump, so with DAPO's overlong penalty the line shows the score before it)."""
        inputs, outputs = self.decode_rows(batch)
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / f"{self.global_step}.jsonl", "w") as out:
            for i, score in enumerate(scores):
                line = {"input": inputs[i], "output": outputs[i], "score": score, "step": self.global_step}
                if "messages" in batch:          # multi-turn: the whole conversation, tool answers included
                    line["messages"] = batch["messages"][i]
                line.update(extras[i])
                # numpy/torch values as numbers and lists; anything else JSON has no type for as its text
                out.write(json.dumps(line, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v)) + "\n")

    def decode_rows(self, batch):
        """(prompt texts, response texts) of a rollout batch, special tokens skipped, as verl decodes them."""
        def decode(ids, mask):
            return self.tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)

        prompt_len, masks = batch["prompts"].shape[1], batch["attention_mask"]
        return ([decode(prompt, mask[:prompt_len]) for prompt, mask in zip(batch["prompts"], masks)],
                [decode(response, mask[prompt_len:]) for response, mask in zip(batch["responses"], masks)])

    def greedy_baselines(self, prompt_batch):
        """ReMax's baseline b_i: the score of a greedy response to the same prompt (verl's gen_max phase)."""
        sampling = Sampling.from_config(self.cfg.actor_rollout_ref.rollout)
        sampling.do_sample = False
        greedy = self.generate(prompt_batch, sampling, "gen_max")
        mine = rows_of_rank(batch_size_of(greedy), self.rank, self.world_size)
        return all_gather_rows(self.score(take(greedy, mine))[0], self.world_size)

    # -- validation -----------------------------------------------------------------------------------------
    def validate(self):
        """Generate for the whole validation set with val_kwargs (greedy by default) and score it:
        val-core/<data_source>/reward/mean@N."""
        arr = self.cfg.actor_rollout_ref
        n = arr.rollout.val_kwargs.n
        rows = [self.val_set[i] for i in range(len(self.val_set))]
        batch = repeat_interleave(collate(rows), n)
        total = batch_size_of(batch)
        pad = (-total) % self.world_size                  # pad to a multiple of the world size, as verl does
        batch = take(batch, list(range(total)) + [total - 1] * pad)
        batch = self.generate(batch, Sampling.from_config(arr.rollout, validate=True), "val")
        local = take(batch, rows_of_rank(batch_size_of(batch), self.rank, self.world_size))
        scores, extras = self.score(local)
        scores = all_gather_rows(scores, self.world_size)[:total].tolist()
        extras = all_gather_rows(extras, self.world_size)[:total]
        batch = take(batch, list(range(total)))           # the padding rows out again
        if self.cfg.trainer.validation_data_dir and self.rank == 0:
            self.dump_generations(self.cfg.trainer.validation_data_dir, batch, scores, extras)
        if self.cfg.trainer.log_val_generations and self.rank == 0:     # a few of them to TensorBoard / wandb
            count = self.cfg.trainer.log_val_generations
            self.tracker.log_generations(pick_validation_generations(*self.decode_rows(batch), scores, count),
                                         self.global_step)
        metrics = validation_metrics(scores, batch[self.cfg.data.reward_fn_key], n, extras)
        metrics["val-aux/response_length/mean"] = float(batch["response_mask"].sum(-1).float().mean())
        if "num_turns" in batch:        # multi-turn: verl's val-aux/num_turns/*, and the tool calls beside them
            metrics.update({f"val-aux/{name}": value for name, value in agent.multi_turn_metrics(batch).items()})
        return metrics

    # -- the loop -------------------------------------------------------------------------------------------
    def fit(self):
        """Train from self.global_step (0, or where the checkpoint left off) to total_steps. The loader carries
        the data position, so a resume at an epoch boundary goes on with the next epoch."""
        cfg = self.cfg
        if self.global_step >= self.total_steps and not cfg.trainer.val_only:
            if self.rank == 0:        # a rerun of a finished run (e.g. a retried job): no second validation row
                print(f"the run is already complete (resumed at step {self.global_step} of {self.total_steps}); "
                      f"raise trainer.total_training_steps or trainer.total_epochs to train on", flush=True)
            return
        if self.val_set is not None and cfg.trainer.val_before_train:
            self.tracker.log(self.validate(), step=self.global_step)
            if cfg.trainer.val_only:
                return
        bar = tqdm(total=self.total_steps, initial=self.global_step, disable=self.rank != 0, desc="steps",
                   file=sys.stderr)
        skipped_in_a_row = 0
        while self.global_step < self.total_steps and self.data_left():
            # split devices: the pipeline takes the prompts from the loader itself, one step ahead
            for prompts in self.loader if self.pipeline is None else itertools.repeat(None):
                self.global_step += 1
                skipped_before = self.actor.skipped_steps
                metrics = self.train_step(prompts)
                if metrics is None:              # dynamic sampling ran out of data before the step was full
                    self.global_step -= 1
                    break
                skipped = self.actor.skipped_steps > skipped_before
                skipped_in_a_row = skipped_in_a_row + 1 if skipped else 0
                is_last = self.global_step >= self.total_steps
                test_freq = cfg.trainer.test_freq
                if self.val_set is not None and test_freq > 0 and (is_last or self.global_step % test_freq == 0):
                    start = time.perf_counter()
                    metrics.update(self.validate())
                    metrics["timing_s/testing"] = time.perf_counter() - start
                metrics["training/global_step"] = self.global_step
                metrics["training/epoch"] = self.loader.epoch if self.pipeline is None else self.pipeline.epoch
                metrics["actor/skipped_steps"] = self.actor.skipped_steps
                if checkpoint.due(cfg.trainer.save_freq, self.global_step, is_last) and not skipped:
                    start = time.perf_counter()
                    if self.pipeline is not None:
                        self.pipeline.settle()        # the batch in flight goes into the checkpoint
                    # the row goes in too: a kill between the save and the append below must not lose the step
                    checkpoint.save(cfg, self.global_step, self.roles, self.loader, self.processor or self.tokenizer,
                                    self.stateful, metrics=dict(metrics))    # VL: the processor too
                    metrics["timing_s/save_checkpoint"] = time.perf_counter() - start
                self.tracker.log(metrics, step=self.global_step)
                bar.update(1)
                if skipped:
                    self.stop_if_diverged(skipped_in_a_row, metrics)
                if is_last:
                    break
        bar.close()
        if self.global_step < self.total_steps and self.rank == 0:
            print(f"trainer.total_epochs={cfg.trainer.total_epochs} of data were used up after step "
                  f"{self.global_step} of {self.total_steps} (dynamic sampling draws more than one batch a step)",
                  flush=True)

    def data_left(self):
        """Whether the loop goes on: always, but with dynamic sampling, which ends with trainer.total_epochs of
        data (as verl's DAPO trainer) since its steps use a varying number of batches."""
        return not self.cfg.algorithm.filter_groups.enable or self.loader.data_left(self.cfg.trainer.total_epochs)

    def stop_if_diverged(self, skipped_in_a_row, metrics):
        """Warn about a skipped (non-finite) update; NONFINITE_STEPS_TO_STOP of them in a row end the run.
        Skipped steps are never checkpointed, so the last checkpoint holds the last good state."""
        if self.rank == 0:
            print(f"warning: step {self.global_step}: non-finite loss or gradient norm (actor/pg_loss="
                  f"{metrics.get('actor/pg_loss')}, actor/grad_norm={metrics.get('actor/grad_norm')}); the update "
                  f"was skipped ({skipped_in_a_row} in a row)", file=sys.stderr, flush=True)
        if skipped_in_a_row < NONFINITE_STEPS_TO_STOP:
            return
        last_good = checkpoint.latest(self.cfg.trainer.default_local_dir)
        actor = self.cfg.actor_rollout_ref.actor
        raise TrainingDiverged(
            f"steps {self.global_step - skipped_in_a_row + 1}-{self.global_step}: the loss or gradient norm was "
            f"NaN/inf {skipped_in_a_row} steps in a row, so training stopped. Likely causes: the learning rate "
            f"(actor.optim.lr={actor.optim.lr}: lower it or add warmup), the KL term (kl_loss_coef="
            f"{actor.kl_loss_coef}, kl_loss_type={actor.kl_loss_type}), or the data (NaN/inf rewards, broken "
            f"prompts). Last good checkpoint: {last_good or 'none saved'}"
            + (" (trainer.resume_mode=auto resumes from it)" if last_good else ""))

    def close(self):
        """After a successful run only (a failed one ends in failures.exit_now): flush the logs, wait for every
        rank, then stop the rollout engine: vLLM's shutdown destroys the default process group, so it comes after
        the last collective."""
        self.tracker.close()
        if dist.is_initialized():
            dist.barrier()
        self.rollout.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


def varied_groups(batch, metric):
    """Row indices of the uid groups (a prompt's responses) whose `metric` varies: np.std > 0, as verl's DAPO
    trainer (a group of one response is kept). metric: seq_reward (the score), seq_final_reward (the same here:
    the in-reward KL is refused with dynamic sampling) or a key of the reward function's dict result."""
    if metric in ("seq_reward", "seq_final_reward"):
        values = batch["scores"].tolist()
    else:
        missing = [row for row, extra in enumerate(batch["reward_extras"]) if metric not in extra]
        if missing:
            has = sorted(batch["reward_extras"][missing[0]])
            raise ConfigError(f"algorithm.filter_groups.metric={metric!r} is not in what the reward function "
                              f"returned for {batch['origin'][missing[0]]} (its keys: "
                              f"{has or 'none, it returns a number'}); use seq_reward, seq_final_reward or one of "
                              f"those keys")
        values = [extra[metric] for extra in batch["reward_extras"]]
    groups = uid_groups(batch)
    try:
        spreads = [np.std([values[row] for row in group]) for group in groups]
    except (TypeError, ValueError) as error:
        raise ConfigError(f"algorithm.filter_groups.metric={metric!r} holds values that are not numbers "
                          f"({type(values[0]).__name__}); choose a numeric one") from error
    return [group for group, spread in zip(groups, spreads) if spread > 0 or len(group) == 1]


def update_is_on_policy(cfg, global_step):
    """Whether the actor's update provably takes no optimizer step before its last forward, so its own log-probs
    (detached) are the old log-probs (the actor's before this update, which verl recomputes) and their separate
    pass can be skipped: one PPO epoch, the whole batch as one mini-batch, the actor updating this step
    (critic_warmup), and no KL in the reward (that needs the old log-probs before the update). Colocated, those
    are also the weights that sampled; on split devices the sampling weights are one update older either way.
    verl recomputes always; the result is the same up to fp32 rounding (tests/test_trainer.py)."""
    actor = cfg.actor_rollout_ref.actor
    return (actor.ppo_epochs == 1 and actor.ppo_mini_batch_size >= cfg.data.train_batch_size
            and global_step >= cfg.trainer.critic_warmup and not cfg.algorithm.use_kl_in_reward)


def sync_rollout(actor, engine):
    """Give the engine the actor's current weights: all of them, or with LoRA the adapter only (plus the base
    weights once, when the engine started without them: load_format=dummy*). A collective."""
    if not actor.lora:
        engine.sync_weights(actor.full_weights())
        return
    base = () if engine.base_loaded else actor.base_weights()
    engine.sync_weights(base, adapter=actor.adapter())


# ----------------------------------------------------------------------------------------------------------------
# Entry point


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Overrides, as verl's: key.path=value, +key.path=value, key=[a,b]; with or "
                                            "without 'backend_config.'")
    parser.add_argument("--config", help="yaml config (seed shape or verl shape)")
    parser.add_argument("--config-path", "-cp", metavar="DIR", help="Hydra's form, as verl's run scripts pass it: "
                        "the folder of --config-name")
    parser.add_argument("--config-name", "-cn", metavar="NAME", help="Hydra's form: the config file DIR/NAME.yaml "
                        "(its defaults list is composed: plain names and _self_)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and batch plan")
    parser.add_argument("--world-size", type=int, help="with --print-config: the number of processes to plan for "
                        "(default: trainer.nnodes x trainer.n_gpus_per_node when set, else 1); with --to-verl: "
                        "trainer.n_gpus_per_node when it is null")
    parser.add_argument("--to-verl", action="store_true",
                        help="print verl's command line (python3 -m verl.trainer.main_ppo ...) for the resolved config")
    parser.add_argument("--plot", metavar="RUN_DIR", help="write RUN_DIR/reward_curve.png from metrics.jsonl")
    parser.add_argument("--export", nargs=2, metavar=("CKPT", "OUT"),
                        help="write a checkpoint's actor (CKPT: .../global_step_N or its actor/ folder) to OUT in "
                             "Hugging Face format (config, tokenizer, safetensors); no torchrun needed. A LoRA "
                             "checkpoint exports its adapter (peft format)")
    parser.add_argument("--merge-adapter", action="store_true",
                        help="with --export of a LoRA checkpoint: write the base model with the adapter merged in")
    parser.add_argument("overrides", nargs="*")
    return parser.parse_args(argv)


def print_config(cfg, world_size, source):
    plan = batch_plan(cfg, world_size)           # a batch that does not divide: the error alone, not after the tree
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    print(f"planning for world size {world_size} ({source})")
    steps, rows = None, None
    try:
        files = cfg.data.train_files if isinstance(cfg.data.train_files, list) else [cfg.data.train_files]
        rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
        steps = total_training_steps(cfg, rows // generation_batch_size(cfg))
    except (OSError, ImportError, ValueError):      # hdfs://, or not parquet (pyarrow's ArrowInvalid): plan only
        pass
    if rows is not None and rows < generation_batch_size(cfg):
        print(format_plan(plan))
        print(f"  no training step: data.train_files hold {rows} rows, fewer than one batch of "
              f"{generation_batch_size(cfg)} prompts; a run stops there (lower data.train_batch_size or add data)")
        return
    print(format_plan(plan, steps))


def main(argv=None):
    failures.watch_parent(LAUNCHER_PID)
    args = parse_args(argv)
    if args.plot:
        plot(args.plot)
        return 0
    if args.export:
        try:
            checkpoint.export_hf(*args.export, merge_adapter=args.merge_adapter)
        except checkpoint.CheckpointError as err:
            print(f"checkpoint error: {err}", file=sys.stderr)
            return 2
        return 0
    try:
        path = config_file_path(args.config, args.config_path, args.config_name)
        cfg = load_config(path, args.overrides, world_size=args.world_size)
        if int(os.environ.get("RANK", "0")) == 0 and not args.to_verl:
            for warning in settings_without_effect(cfg):
                print(f"warning: {warning}", file=sys.stderr)
        if args.print_config:
            print_config(cfg, *planning_world_size(cfg, args.world_size))
            return 0
        if args.to_verl:
            print(to_verl(cfg, args.world_size), end="")
            return 0
    except ConfigError as err:
        if int(os.environ.get("RANK", "0")) == 0:          # every rank reads the same config: say it once
            print(f"config error: {err}", file=sys.stderr)
        # but every rank tells torchrun: whichever exits first is its root cause, and rank 0 may not get that far
        failures.tell_torchrun(f"config error: {err}", time.time())
        return 2
    return train(cfg)


def train(cfg):
    """Set up and train. Any failure on any rank (an exception, Ctrl-C) is printed once and ends this process
    at once, without the closing barrier the other ranks would never reach (failures.py); torchrun then stops
    the rest. Returns the exit code: 0, 2 for bad input, 3 for a diverged run, 1 otherwise, 130 interrupted; with
    several ranks the process ends here instead, with that code, success included."""
    known = [(ConfigError, "config error", 2), (checkpoint.CheckpointError, "checkpoint error", 2)]
    trainer, expected = None, known + [(ValueError, "error", 2), (FileNotFoundError, "error", 2)]  # bad data/model
    failures.report_sigterm()
    failures.report_crashes()
    try:
        if offpolicy.is_rollout_rank(cfg):        # split devices: this rank generates (offpolicy.py)
            trainer = offpolicy.RolloutServer(cfg, *pick_device(cfg.trainer.device))
        else:
            trainer = Trainer(cfg)
        # a ValueError now is a bug: traceback
        expected = known + [(TrainingDiverged, "training stopped", 3), (TooFewVariedGroups, "training stopped", 3)]
        trainer.fit()
    except BaseException as err:                                    # Ctrl-C (KeyboardInterrupt) too
        return failures.exit_now(failures.report(err, failures.TORCHRUN_RANK, expected))
    several_ranks = dist.is_initialized() and dist.get_world_size() > 1      # close() ends torch.distributed
    trainer.close()
    if several_ranks:
        # A successful run with other ranks skips Python's teardown too. gloo's worker threads may still be
        # releasing the last collectives' tensors, which takes the GIL, and a thread that takes it while the
        # interpreter finalizes aborts the process: SIGABRT after a run that succeeded (pytorch issue 190489).
        failures.leave(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
