"""Checkpoints: save, resume, validate, prune, and export to Hugging Face format.

The trainer calls two functions (a "role" is a trained model: the actor and, for PPO, the critic; any object with
.model (FSDP2), .optimizer, .scheduler, .checkpoint_counters(), .load_checkpoint_counters(dict) and .on_device(), the
context that brings offloaded weights and optimizer state to the device: models.Worker):

    step, row = checkpoint.resume(cfg, {"actor": actor}, loader)  # in Trainer.__init__: (0, None) when fresh
    checkpoint.save(cfg, step, {"actor": actor}, loader, tokenizer, metrics=row)   # every save_freq steps, the last

and the command line exports a checkpoint without torchrun:

    python minirl.py --export outputs/demo/checkpoints/global_step_100 exported/      # or .../global_step_100/actor
    python minirl.py --export CKPT OUT [--merge-adapter]     # LoRA: the adapter, or the base with it merged in

Layout (verl v0.5.0's: verl/utils/checkpoint/fsdp_checkpoint_manager.py FSDPCheckpointManager, written by
verl/trainer/ppo/ray_trainer.py RayPPOTrainer._save_checkpoint; W = world size, R = rank):

    <trainer.default_local_dir>/
      latest_checkpointed_iteration.txt      N, written after everything else
      global_step_N/
        actor/model_world_size_W_rank_R.pt   this rank's FSDP2 shards, {name: local tensor}
              optim_world_size_W_rank_R.pt   this rank's optimizer state (local shards)
              extra_state_world_size_W_rank_R.pt   LR scheduler, this rank's RNG states, skipped-step counters
              fsdp_config.json               {"FSDP_version": 2, "world_size": W}
              huggingface/                   config, generation config, tokenizer; safetensors weights too when
                                             actor.checkpoint.save_contents has "hf_model" (LoRA: merged)
              lora_adapter/                  LoRA only: adapter_model.safetensors + adapter_config.json, peft's
                                             format (PeftModel.from_pretrained(base, this folder))
        data.pt                              the prompt loader's position (epoch, batches done)
        trainer_state.json                   global step, the step's metrics row (+ state of any extra stateful
                                             object, e.g. a KL controller)
        manifest.json                        every file above with its size and blake2b checksum: the "complete"
                                             marker, written last

A save writes into `global_step_N.incomplete/`; each rank hashes the files it wrote, rank 0 gathers the checksums,
writes the manifest, renames the folder into place and only then updates latest_checkpointed_iteration.txt, so a
run killed mid-save leaves nothing that looks complete. resume_mode=auto takes the newest global_step_N whose files
all match the manifest (size and checksum: a truncated, missing or flipped-byte file is caught), says which ones it
skipped and why, and stops with an error when checkpoints exist but none is intact (resume_mode=disable starts
over). Shards are tied to the world size and to the sharding groups (fsdp_size, models.fsdp_mesh): resuming with
another number of ranks or another grouping is refused (export to HF and start a new run from the export instead).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError

import vision
from batch_plan import FSDP_SIZE_KEY, fsdp_group_size
from config import get_dotted

STEP_DIR = re.compile(r"^global_step_(\d+)$")
TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
FORMAT = "minirl-checkpoint-2"          # 2: files map to {"bytes", "blake2b"}; 1 held sizes only
CONTENTS = ("model", "optimizer", "extra", "hf_model")
LOADABLE = ("model", "optimizer", "extra")         # hf_model is a copy for users, never read back
LORA_DIR = "lora_adapter"
# role -> (its checkpoint settings in the config, its trainer.max_*_ckpt_to_keep key)
ROLE_KEYS = {"actor": ("actor_rollout_ref.actor.checkpoint", "max_actor_ckpt_to_keep"),
             "critic": ("critic.checkpoint", "max_critic_ckpt_to_keep")}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and what to do."""


def _shard_file(kind, world_size, rank):
    return f"{kind}_world_size_{world_size}_rank_{rank}.pt"


def _rank_and_world():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier():
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _log(message):
    if _rank_and_world()[0] == 0:
        print(f"[checkpoint] {message}", file=sys.stderr, flush=True)


def save_contents(cfg, role):
    """The role's checkpoint.save_contents, checked against what minirl can save."""
    return _contents(cfg, f"{ROLE_KEYS[role][0]}.save_contents", CONTENTS, "such a checkpoint could not be resumed")


def load_contents(cfg, role):
    """The role's checkpoint.load_contents: what a resume reads of the role's checkpoint (verl's
    FSDPCheckpointManager.load_checkpoint). Without 'optimizer' the optimizer starts fresh; without 'extra' the
    LR schedule, the RNG and the skipped-step count do. The step, the data position and the KL controller come
    back whatever it says (the trainer's state, as in verl)."""
    return _contents(cfg, f"{ROLE_KEYS[role][0]}.load_contents", LOADABLE, "a resume continues from the weights")


def _contents(cfg, dotted, allowed, why_model):
    contents = list(get_dotted(cfg, dotted))
    unknown = [c for c in contents if c not in allowed]
    if unknown:
        raise CheckpointError(f"'{dotted}' has {unknown}; allowed: {list(allowed)}")
    if "model" not in contents:
        raise CheckpointError(f"'{dotted}'={contents} lacks 'model': {why_model}")
    return contents


# ----------------------------------------------------------------------------------------------------------------
# What one rank holds: local shards of DTensors, RNG states


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def param_layout(model):
    """{name: {"shape": global shape, "shard_dim": dim FSDP shards along, or None, "shard_ranks": how many ranks
    hold the shards of one copy}} of the model's state dict. shard_ranks is the world size, or with HSDP
    (fsdp_size, models.fsdp_mesh) the group size: ranks 0..shard_ranks-1 then hold one whole copy."""
    layout = {}
    for name, tensor in model.state_dict().items():
        placements = getattr(tensor, "placements", ())
        sharded = [(mesh_dim, p.dim) for mesh_dim, p in enumerate(placements) if hasattr(p, "dim")]
        layout[name] = {"shape": list(tensor.shape), "shard_dim": sharded[0][1] if sharded else None,
                        "shard_ranks": tensor.device_mesh.size(sharded[0][0]) if sharded else 1}
    return layout


def _model_shard(model):
    return {name: _local(tensor).detach().cpu() for name, tensor in model.state_dict().items()}


def _load_model_shard(model, shard, path):
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            local = _local(tensor)
            if name not in shard or shard[name].shape != local.shape:
                raise CheckpointError(f"{path}: the shard of '{name}' does not fit this rank's "
                                      f"{tuple(local.shape)} (different model or sharding)")
            local.copy_(shard[name])


def _optimizer_shard(optimizer):
    """optimizer.state_dict() with each DTensor replaced by its local shard (and the places they were)."""
    state = optimizer.state_dict()        # its per-parameter dicts are the live ones: build new dicts, not edit
    dtensors = [[param_id, key] for param_id, entries in state["state"].items()
                for key, value in entries.items() if hasattr(value, "to_local")]
    state["state"] = {param_id: {key: _local(value).detach().cpu() for key, value in entries.items()}
                      for param_id, entries in state["state"].items()}
    return {"state_dict": state, "dtensor_entries": dtensors}


def _load_optimizer_shard(optimizer, saved):
    from torch.distributed.tensor import DTensor
    state = saved["state_dict"]
    saved_ids = [i for group in state["param_groups"] for i in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    param_of = dict(zip(saved_ids, params))
    for param_id, key in saved["dtensor_entries"]:
        param = param_of[param_id]
        local = state["state"][param_id][key].to(param.device)
        state["state"][param_id][key] = DTensor.from_local(local, param.device_mesh, param.placements,
                                                           run_check=False, shape=param.shape, stride=param.stride())
    optimizer.load_state_dict(state)


def rng_state():
    """This process's RNG states: python, numpy, torch CPU and (when present) the accelerator's."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [name, keys.tolist(), pos, has_gauss, gauss],
             "torch": torch.get_rng_state()}
    for device in ("cuda", "npu"):
        module = getattr(torch, device, None)
        if module is not None and module.is_available():
            state[device] = module.get_rng_state_all()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    for device in ("cuda", "npu"):
        if device in state:
            getattr(torch, device).set_rng_state_all(state[device])


# ----------------------------------------------------------------------------------------------------------------
# Save


def due(save_freq, step, is_last):
    """verl: save every save_freq steps and at the last step (save_freq <= 0: never)."""
    return save_freq > 0 and (is_last or step % save_freq == 0)


def save(cfg, step, roles, loader, tokenizer, stateful=None, metrics=None):
    """Write global_step_<step> (all ranks call this). `stateful`: extra {name: object with state_dict()},
    JSON-serialisable, kept in trainer_state.json (e.g. {"kl_ctrl": controller}). `metrics`: the step's
    metrics row, kept there too: the trainer appends it to metrics.jsonl after the save, so a run killed in
    between gets it back on resume."""
    rank, world_size = _rank_and_world()
    root = Path(cfg.trainer.default_local_dir)
    final = root / f"global_step_{step}"
    staging = root / f"global_step_{step}.incomplete"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        with writing_into(staging):
            staging.mkdir(parents=True)
    _barrier()
    manifest_roles = {}
    for name, role in roles.items():
        contents = save_contents(cfg, name)
        manifest_roles[name] = {"contents": contents, "params": param_layout(role.model)}
        with role.on_device():
            _save_role(staging / name, role, contents, tokenizer, rank, world_size)
    if rank == 0:
        trainer_state = {"global_step": step, "metrics": metrics,
                         "stateful": {key: obj.state_dict() for key, obj in (stateful or {}).items()}}
        with writing_into(staging):
            torch.save(loader.state_dict(), staging / "data.pt")
            (staging / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
    _barrier()
    digests = _gather_digests(staging, rank, world_size)
    if rank == 0:
        with writing_into(staging):
            _write_manifest(staging, step, world_size, manifest_roles, digests)
            _replace(staging, final)
            _write_atomically(root / TRACKER, str(step))
        prune(root, _keep(cfg, roles))
    _barrier()
    _log(f"saved {final}")
    return final


def _save_role(folder, role, contents, tokenizer, rank, world_size):
    shards = {"model": _model_shard(role.model)}
    if "optimizer" in contents:
        shards["optim"] = _optimizer_shard(role.optimizer)
    if "extra" in contents:
        shards["extra_state"] = {"lr_scheduler": role.scheduler.state_dict(), "rng": rng_state(),
                                 "counters": role.checkpoint_counters()}
    with writing_into(folder.parent):
        folder.mkdir(parents=True, exist_ok=True)
        for kind, state in shards.items():
            torch.save(state, folder / _shard_file(kind, world_size, rank))
    weights = None
    if "hf_model" in contents:
        from models import full_state_dict_items           # a collective: every rank gathers every tensor
        weights = {name: tensor.cpu() for name, tensor in full_state_dict_items(role.model)}
    adapter = role.adapter() if getattr(role, "lora", False) else None       # a collective too
    if rank == 0:
        with writing_into(folder.parent):
            (folder / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world_size}))
            hf_dir = folder / "huggingface"
            role.model.config.save_pretrained(hf_dir)
            if getattr(role.model, "generation_config", None) is not None:
                role.model.generation_config.save_pretrained(hf_dir)
            tokenizer.save_pretrained(hf_dir)
            if adapter is not None:
                adapter.save(folder / LORA_DIR)
            if weights is not None:
                write_hf_weights(weights, hf_dir, adapter_folder=folder / LORA_DIR if adapter is not None else None)


SAVE_FIX = ("Free space, point trainer.default_local_dir at a larger disk or keep fewer checkpoints "
            "(trainer.max_actor_ckpt_to_keep); the checkpoints saved before are intact")


@contextmanager
def writing_into(staging, fix=SAVE_FIX):
    """Around the file writes of a save (or an export), and only those: a write that fails (a full disk, a quota, a
    lost mount; torch.save reports these as a RuntimeError such as "unexpected pos" or "iostream error",
    safetensors as its own SafetensorError) becomes a CheckpointError that names the folder, the space now left on
    its file system and `fix`. The newest checkpoint before it is still whole (a half-written folder is never
    renamed into place, and resuming picks the newest intact one); the next save removes the staging folder."""
    try:
        yield
    except CheckpointError:
        raise
    except (OSError, RuntimeError, SafetensorError) as err:
        try:
            usage = shutil.disk_usage(staging.parent)
            space = f"; that file system now has {usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB"
        except OSError:
            space = ""
        detail = (str(err).strip().splitlines() or [""])[-1][:200]
        raise CheckpointError(f"writing {staging} failed ({type(err).__name__}: {detail}){space}. {fix}") from err


def file_digest(path):
    """blake2b of a file's bytes (hex), read in chunks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "blake2b").hexdigest()


def _gather_digests(folder, rank, world_size):
    """{relative name: {"bytes", "blake2b"}} of every file in `folder`, on rank 0 (None elsewhere). Each rank
    hashes the shard files it wrote (..._rank_R.pt), rank 0 the shared ones too, so the hashing is spread over
    the ranks and every file is read once, just after it was written."""
    mine = {}
    for path in sorted(folder.rglob("*")):
        shard_rank = re.search(r"_rank_(\d+)\.pt$", path.name)
        if path.is_file() and (int(shard_rank.group(1)) == rank if shard_rank else rank == 0):
            mine[str(path.relative_to(folder))] = {"bytes": path.stat().st_size, "blake2b": file_digest(path)}
    if world_size == 1 or not dist.is_initialized():
        return mine
    gathered = [None] * world_size
    dist.all_gather_object(gathered, mine)
    return {name: entry for part in gathered for name, entry in part.items()} if rank == 0 else None


def _write_manifest(folder, step, world_size, roles, files):
    manifest = {"format": FORMAT, "global_step": step, "world_size": world_size, "roles": roles, "files": files}
    path = folder / MANIFEST
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _replace(staging, final):
    """Move the finished folder into place (a same-step folder from an earlier run is replaced)."""
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(staging, final)
        shutil.rmtree(old)
    else:
        os.rename(staging, final)


def _write_atomically(path, text):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _keep(cfg, roles):
    """How many checkpoints to keep: the smallest max_<role>_ckpt_to_keep set (None/<=0: all)."""
    limits = [cfg.trainer[ROLE_KEYS[name][1]] for name in roles]
    limits = [limit for limit in limits if limit is not None and limit > 0]
    return min(limits) if limits else None


def step_dirs(root):
    """[(N, path)] of the global_step_N folders under root, newest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def prune(root, keep):
    """Delete all but the newest `keep` complete checkpoints (keep None: delete none), and any leftover
    *.incomplete folder of an interrupted save."""
    root = Path(root)
    for leftover in root.glob("global_step_*.incomplete"):
        shutil.rmtree(leftover, ignore_errors=True)
    if keep is None:
        return
    complete = [path for _, path in step_dirs(root) if not problems(path, checksums=False)]
    for path in complete[keep:]:
        shutil.rmtree(path)


# ----------------------------------------------------------------------------------------------------------------
# Validate and resume


def problems(step_dir, checksums=True):
    """Why `step_dir` is not an intact checkpoint (a message naming the file), or None if it is: the manifest is
    readable and lists the files a resume needs, and every file listed has its size and (checksums=True) its
    blake2b checksum. A manifest of format 1 (sizes only) is checked by size."""
    step_dir = Path(step_dir)
    manifest_path = step_dir / MANIFEST
    if not manifest_path.is_file():
        return (f"{manifest_path} is missing: the save was interrupted before it finished (the manifest is "
                f"written last) or the folder was not written by minirl")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = {name: entry if isinstance(entry, dict) else {"bytes": entry}
                 for name, entry in manifest["files"].items()}
        sizes = {name: int(entry["bytes"]) for name, entry in files.items()}
        world_size, roles, step = int(manifest["world_size"]), list(manifest["roles"]), int(manifest["global_step"])
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{manifest_path} is unreadable ({type(err).__name__}: {err})"
    named = STEP_DIR.match(step_dir.name)
    if named and int(named.group(1)) != step:
        return f"{manifest_path} is for global step {step}, not {named.group(1)}"
    needed = ["data.pt", "trainer_state.json"] + [f"{role}/{_shard_file('model', world_size, r)}"
                                                  for role in roles for r in range(world_size)]
    unlisted = [name for name in needed if name not in files]
    if unlisted:
        return f"{manifest_path} does not list {unlisted}"
    for name, size in sizes.items():
        path = step_dir / name
        if not path.is_file():
            return f"{path} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{path} is truncated or altered: {actual} bytes, the manifest says {size}"
    for name, entry in files.items():
        if checksums and "blake2b" in entry and file_digest(step_dir / name) != entry["blake2b"]:
            return f"{step_dir / name} is corrupted: its bytes do not match the manifest's blake2b checksum"
    return None


def read_manifest(step_dir):
    """The manifest of a complete checkpoint, else CheckpointError."""
    problem = problems(step_dir)
    if problem:
        raise CheckpointError(f"checkpoint '{step_dir}' is incomplete: {problem}")
    return json.loads((Path(step_dir) / MANIFEST).read_text())


def validate(step_dir, world_size, roles):
    """Check that `step_dir` is a complete global_step_N checkpoint that this run can load: same world size,
    and for each role the same parameter names and shapes, sharded over groups of as many ranks. `roles`:
    {name: param_layout(model)}. Returns the manifest."""
    step_dir = Path(step_dir)
    if not STEP_DIR.match(step_dir.name) or not step_dir.is_dir():
        state = "does not exist" if not step_dir.exists() else "is not a checkpoint folder"
        raise CheckpointError(f"'{step_dir}' {state}: trainer.resume_from_path must name a .../global_step_N "
                              f"folder written by minirl")
    manifest = read_manifest(step_dir)
    _check_world_size(step_dir, manifest, world_size)
    for name, layout in roles.items():
        if name not in manifest["roles"]:
            raise CheckpointError(f"checkpoint '{step_dir}' has no '{name}' model (it has "
                                  f"{sorted(manifest['roles'])})")
        saved = {key: value["shape"] for key, value in manifest["roles"][name]["params"].items()}
        here = {key: value["shape"] for key, value in layout.items()}
        if saved != here:
            raise CheckpointError(f"checkpoint '{step_dir}' holds a different {name} model than "
                                  f"this run's: {_first_difference(saved, here)}{_lora_hint(saved, here)}. Resume "
                                  f"with the model it was trained from, or set trainer.resume_mode=disable (or "
                                  f"another trainer.default_local_dir) to start fresh")
        _check_grouping(step_dir, manifest, name, _shard_ranks(layout, world_size))
    return manifest


def _check_grouping(step_dir, manifest, name, group_ranks):
    """`name`'s shards load only onto groups of as many ranks as wrote them (fsdp_size, models.fsdp_mesh)."""
    world_size = manifest["world_size"]
    saved_ranks = _shard_ranks(manifest["roles"][name]["params"], world_size)
    if saved_ranks != group_ranks:
        value = f"{saved_ranks}" + (" (or -1: all ranks)" if saved_ranks == world_size else "")
        raise CheckpointError(f"checkpoint '{step_dir}' shards its {name} model over groups of {saved_ranks} "
                              f"ranks and this run over {group_ranks} ({FSDP_SIZE_KEY[name]}): its shards only "
                              f"load with the same grouping. Resume with {FSDP_SIZE_KEY[name]}={value}, or export "
                              f"the model (python minirl.py --export {step_dir / name} OUT) and start a new run "
                              f"from OUT")


def _check_world_size(step_dir, manifest, world_size):
    if manifest["world_size"] != world_size:
        raise CheckpointError(
            f"checkpoint '{step_dir}' was written by {manifest['world_size']} ranks and this run has {world_size}: "
            f"its shards only load with the same world size. Resume with --nproc_per_node "
            f"{manifest['world_size']}, or export it (python minirl.py --export {step_dir} OUT) and start a new run "
            f"with actor_rollout_ref.model.path=OUT")


def check_before_loading(cfg, world_size):
    """Before any model loads, not minutes later once the models and the rollout engine have started: each role's
    save_contents and load_contents, and that the checkpoint a resume would read (resume_from_path's, or auto's
    newest complete one by the sizes in its manifest) was written by as many ranks as this run has, in groups of as
    many as this run's fsdp_size makes, since only then do its shards load. The rest is checked when the models
    exist (validate, with the checksums)."""
    roles = ["actor"] + (["critic"] if cfg.algorithm.adv_estimator == "gae" else [])
    for role in roles:
        save_contents(cfg, role)
        load_contents(cfg, role)
    trainer = cfg.trainer
    if trainer.resume_mode == "disable":
        return
    if trainer.resume_mode == "resume_path":
        candidates = [Path(trainer.resume_from_path)] if trainer.resume_from_path else []
    else:
        candidates = [path for _, path in step_dirs(trainer.default_local_dir)]
    for step_dir in candidates:
        if STEP_DIR.match(step_dir.name) and problems(step_dir, checksums=False) is None:
            manifest = json.loads((step_dir / MANIFEST).read_text())
            _check_world_size(step_dir, manifest, world_size)
            for role in roles:
                if role in manifest["roles"]:           # a missing role is named once the models exist (validate)
                    group = fsdp_group_size(get_dotted(cfg, FSDP_SIZE_KEY[role]), world_size)
                    _check_grouping(step_dir, manifest, role, group)
            return


def _lora_rank(layout):
    """The LoRA rank of a parameter layout (lora_A is [r, in]), or 0 without adapters."""
    return next((shape[0] for key, shape in sorted(layout.items()) if ".lora_A." in key), 0)


def _lora_hint(saved, here):
    """When the models differ only in their LoRA settings, which key to set."""
    saved_rank, this_rank = _lora_rank(saved), _lora_rank(here)
    if saved_rank == this_rank:
        return ""
    return (f" (the checkpoint was trained with actor_rollout_ref.model.lora_rank={saved_rank} and this run has "
            f"{this_rank}: set it to {saved_rank}, with the same target_modules)")


def _shard_ranks(params, world_size):
    """Over how many ranks a role's sharded tensors are spread (param_layout); checkpoints from before HSDP did not
    record it: the world size."""
    return max((p.get("shard_ranks", world_size) for p in params.values() if p["shard_dim"] is not None), default=1)


def _first_difference(saved, here):
    for key in sorted(set(saved) | set(here)):
        if saved.get(key) != here.get(key):
            return (f"parameter '{key}' has shape {saved.get(key, 'absent')} in the checkpoint and "
                    f"{here.get(key, 'absent')} here")
    return "no difference"


def latest(root, checksums=True):
    """The newest intact global_step_N under root, or None. Damaged or incomplete ones are skipped, saying why."""
    for _, path in step_dirs(root):
        problem = problems(path, checksums)
        if problem is None:
            return path
        _log(f"skipping damaged or incomplete checkpoint {path}: {problem}")
    return None


def _auto_choice(root):
    """resume_mode=auto on one process: (the newest intact checkpoint or None, an error message or None)."""
    found = step_dirs(root)
    if not found:
        _log(f"no checkpoint in {root}; starting from scratch")
        return None, None
    chosen = latest(root)
    if chosen is None:
        return None, (f"trainer.resume_mode=auto found checkpoints in {root} but none is intact "
                      f"({', '.join(path.name for _, path in found)}; the reasons are printed above). Remove or "
                      f"repair them, resume one explicitly (trainer.resume_mode=resume_path), or start over with "
                      f"trainer.resume_mode=disable")
    tracker = Path(root) / TRACKER
    if tracker.is_file():
        text = tracker.read_text(errors="replace").strip()
        if not text.isdigit():
            _log(f"{tracker} holds {text[:40]!r}, not a step number; ignored")
        elif f"global_step_{int(text)}" != chosen.name:
            _log(f"{tracker} names step {int(text)}; the newest intact checkpoint is {chosen.name}")
    if chosen != found[0][1]:
        _log(f"falling back to the newest intact checkpoint, {chosen}")
    return chosen, None


def _agreed_auto_choice(root):
    """Rank 0 checks the checkpoints (hashing every file once) and tells the other ranks what it found, so all
    ranks resume from the same one or all stop with the same error."""
    rank, world_size = _rank_and_world()
    choice = list(_auto_choice(root)) if rank == 0 else [None, None]
    if world_size > 1:
        dist.broadcast_object_list(choice, src=0)
    step_dir, error = choice
    if error:
        raise CheckpointError(error)
    return step_dir


def _read_json(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} cannot be read ({type(err).__name__}: {err}); the checkpoint is damaged, "
                              f"resume from an earlier global_step_N") from err


def _torch_load(path):
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:       # a damaged file: say which one
        raise CheckpointError(f"{path} cannot be read ({type(err).__name__}: {err}); the checkpoint is damaged, "
                              f"resume from an earlier global_step_N") from err


def resume(cfg, roles, loader, stateful=None):
    """Apply trainer.resume_mode; returns the global step to continue after (0: from scratch) and that step's
    metrics row as saved with it (None when starting fresh or from a checkpoint saved without one). Also checks
    the save and load settings, so a bad save_contents or load_contents fails before training starts."""
    for name in roles:
        save_contents(cfg, name)
    wanted = {name: load_contents(cfg, name) for name in roles}
    trainer = cfg.trainer
    if trainer.resume_mode == "disable":
        return 0, None
    if trainer.resume_mode == "auto":
        step_dir = _agreed_auto_choice(trainer.default_local_dir)
        if step_dir is None:
            return 0, None
    elif not trainer.resume_from_path:
        raise CheckpointError("trainer.resume_mode=resume_path needs trainer.resume_from_path: the "
                              ".../global_step_N folder to resume from")
    else:
        step_dir = Path(trainer.resume_from_path).resolve()
    rank, world_size = _rank_and_world()
    manifest = validate(step_dir, world_size, {name: param_layout(role.model) for name, role in roles.items()})
    for name, role in roles.items():
        with role.on_device():      # the optimizer state is loaded onto its parameters' device
            _load_role(step_dir / name, role, manifest["roles"][name]["contents"], wanted[name], rank, world_size)
    try:
        loader.load_state_dict(_torch_load(step_dir / "data.pt"))
    except ValueError as err:         # the data settings changed since the checkpoint
        raise CheckpointError(f"{step_dir / 'data.pt'}: {err}") from err
    trainer_state = _read_json(step_dir / "trainer_state.json")
    for key, obj in (stateful or {}).items():
        if key not in trainer_state["stateful"]:
            raise CheckpointError(f"{step_dir / 'trainer_state.json'} has no state for '{key}' (the checkpointed "
                                  f"run did not have it); start fresh with trainer.resume_mode=disable")
        obj.load_state_dict(trainer_state["stateful"][key])
    _log(f"resumed from {step_dir} (global step {trainer_state['global_step']}, data epoch {loader.epoch}, "
         f"{loader.batches_done_in_epoch} batches of it done)")
    return trainer_state["global_step"], trainer_state.get("metrics")


def _load_role(folder, role, saved, wanted, rank, world_size):
    """Load what the checkpoint holds (`saved`, its save_contents) and the run asks for (`wanted`, load_contents)."""
    _load_model_shard(role.model, _torch_load(folder / _shard_file("model", world_size, rank)),
                      folder / _shard_file("model", world_size, rank))
    if "optimizer" not in wanted:
        _log(f"{folder}: the optimizer state is not loaded (load_contents lacks 'optimizer'): it starts fresh")
    elif "optimizer" not in saved:
        _log(f"{folder} has no optimizer state (save_contents lacked 'optimizer'): the optimizer starts fresh")
    else:
        _load_optimizer_shard(role.optimizer, _torch_load(folder / _shard_file("optim", world_size, rank)))
    if "extra" not in wanted:
        _log(f"{folder}: the extra state is not loaded (load_contents lacks 'extra'): LR schedule and RNG start "
             f"fresh")
    elif "extra" not in saved:
        _log(f"{folder} has no extra state (save_contents lacked 'extra'): LR schedule and RNG start fresh")
    else:
        extra = _torch_load(folder / _shard_file("extra_state", world_size, rank))
        saved_lr, lr = role.resume_schedule(extra["lr_scheduler"])
        if lr != saved_lr:
            _log(f"{folder}: the LR schedule follows this run's optim settings from here: lr {lr:.6g} where the "
                 f"checkpointed run would have gone on at {saved_lr:.6g}")
        role.load_checkpoint_counters(extra["counters"])
        set_rng_state(extra["rng"])


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face format


def write_hf_weights(state, folder, adapter_folder=None):
    """Save full weights {name: tensor} as a Hugging Face model in `folder` (which already has config.json):
    safetensors, tied weights handled by transformers, loadable by from_pretrained and vLLM as is.
    With `adapter_folder` (a LoRA actor) `state` has peft's names: the base weights are taken from it and the
    adapter is merged into them (peft's merge_and_unload)."""
    import transformers

    import lora
    if adapter_folder is not None:
        state = {lora.base_weight_name(k): v for k, v in state.items() if not lora.is_adapter_name(k)}
    config = transformers.AutoConfig.from_pretrained(folder)
    architecture = getattr(transformers, (config.architectures or ["?"])[0], None)   # e.g. Qwen2ForCausalLM
    with torch.device("meta"):                          # no memory, no random init: the weights are assigned
        model = (architecture._from_config(config) if architecture is not None
                 else transformers.AutoModelForCausalLM.from_config(config))
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    if adapter_folder is not None:
        model = lora.merge(model, adapter_folder)
    model.save_pretrained(folder)


def consolidate(step_dir, role="actor"):
    """Full weights {name: tensor} of `role`, assembled from the shard files of the ranks that hold one copy (all
    ranks; with HSDP the first group) (no processes needed)."""
    step_dir = Path(step_dir)
    manifest = read_manifest(step_dir)
    world_size = manifest["world_size"]
    copy_ranks = _shard_ranks(manifest["roles"][role]["params"], world_size)   # ranks 0.. hold one whole copy
    shards = [_torch_load(step_dir / role / _shard_file("model", world_size, r)) for r in range(copy_ranks)]
    full = {}
    for name, layout in manifest["roles"][role]["params"].items():
        dim = layout["shard_dim"]
        tensor = shards[0][name] if dim is None else torch.cat([shard[name] for shard in shards], dim=dim)
        if list(tensor.shape) != layout["shape"]:
            raise CheckpointError(f"{step_dir / role}: the shards of '{name}' assemble to {list(tensor.shape)}, "
                                  f"the manifest says {layout['shape']}")
        full[name] = tensor
    return full


def export_hf(ckpt, out, merge_adapter=False):
    """`python minirl.py --export CKPT OUT`: CKPT is a global_step_N folder or its actor/ folder; OUT gets
    config, tokenizer and safetensors weights. A LoRA checkpoint exports its adapter (peft's folder, whose
    adapter_config.json names the base model.path), or with merge_adapter the base model with the adapter merged
    in."""
    ckpt = Path(ckpt)
    role = "actor"
    if not STEP_DIR.match(ckpt.name) and STEP_DIR.match(ckpt.parent.name):
        ckpt, role = ckpt.parent, ckpt.name
    if not STEP_DIR.match(ckpt.name):
        raise CheckpointError(f"'{ckpt}' is not a checkpoint: pass a .../global_step_N folder or its actor/ folder")
    adapter_dir = ckpt / role / LORA_DIR
    if merge_adapter and not adapter_dir.is_dir():
        raise CheckpointError(f"'{ckpt / role}' has no {LORA_DIR}/ (it was not trained with LoRA): export it "
                              f"without --merge-adapter")
    read_manifest(ckpt)
    hf_dir = ckpt / role / "huggingface"
    if role == "critic" and vision.folder_is_vision_language(hf_dir):
        raise CheckpointError(f"'{ckpt / role}' is a vision-language critic: its value head (vision.with_value_head) "
                              f"has no Hugging Face class to export to; the checkpoint resumes, it does not export")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"--export: '{out}' exists and is not an empty folder; export into a new folder (an "
                              f"earlier export's files, e.g. merged weights beside an adapter, would mix with these)")
    staging = out.with_name(out.name + ".incomplete")        # renamed into place when complete
    shutil.rmtree(staging, ignore_errors=True)
    export_only = adapter_dir.is_dir() and not merge_adapter
    weights = None if export_only else consolidate(ckpt, role)
    try:
        with writing_into(staging, fix="Free space or export to a larger disk"):
            staging.mkdir(parents=True)
            if export_only:
                import lora
                lora.export_adapter(adapter_dir, hf_dir, staging)
            else:
                for item in hf_dir.iterdir():    # config, generation config, tokenizer (weights are rewritten below)
                    if item.is_file() and item.suffix != ".safetensors" and item.name != "model.safetensors.index.json":
                        shutil.copy2(item, staging / item.name)
                write_hf_weights(weights, staging, adapter_folder=adapter_dir if adapter_dir.is_dir() else None)
            os.replace(staging, out)
    except CheckpointError:
        shutil.rmtree(staging, ignore_errors=True)       # the space a half-written export took goes back
        raise
    what = f"the LoRA adapter of {ckpt / role}" if export_only else str(ckpt / role)
    print(f"exported {what} to {out}")
    return out
