"""Train through the real Trainer with param_offload / optimizer_offload on, checking that no worker's weights or
optimizer state are used while offloaded (for tests/test_ppo.py):

    torchrun --nproc_per_node W tests/offload_probe.py OUT.json key=value ...

On CPU the offload device is the device itself, so a use outside models.Worker.on_device would go unnoticed in
the numbers; the probe watches for it instead: every forward, optimizer step, weight gather and checkpoint
written or read (a resume too) of a worker must happen inside one of its phases. After training, each worker is
offloaded once more to the meta device, which keeps no data: whatever stays behind on the device (a parameter
shard, gradient, buffer or optimizer state) is reported. OUT.json (rank 0): {"uses_outside_a_phase": [...],
"left_on_the_device": {worker: [...]}, "phases": {worker: count}, "offloads": {worker: [params, optimizer]},
"gradients": {worker: parameters holding one after training}}.
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import checkpoint  # noqa: E402
import failures  # noqa: E402
import models  # noqa: E402
from config import load_config  # noqa: E402
from minirl import Trainer  # noqa: E402

OUTSIDE = []          # "<worker>: <use>" for every use of a worker's model outside a phase
PHASES = {}           # worker name -> phases opened


def watch_checkpoints():
    """Report a checkpoint written or read for a role outside its phases (installed before the trainer resumes)."""
    for function_name in ("_save_role", "_load_role"):
        original = getattr(checkpoint, function_name)

        def wrapper(folder, role, *args, original=original, use=function_name):
            if role.phases_open == 0:
                OUTSIDE.append(f"{folder.name}: {use}")
            return original(folder, role, *args)
        setattr(checkpoint, function_name, wrapper)


def watch_workers(workers):
    """Report each use of a worker's model outside on_device: forwards, optimizer steps (hooks on the worker's
    own objects) and weight gathers (models.full_state_dict_items, wrapped where it is looked up); count phases."""
    by_model = {id(worker.model): (name, worker) for name, worker in workers.items()}

    def check(model, use):
        name, worker = by_model.get(id(model), (None, None))
        if worker is not None and worker.phases_open == 0:
            OUTSIDE.append(f"{name}: {use}")

    for name, worker in workers.items():
        worker.model.register_forward_pre_hook(lambda model, args: check(model, "forward"))
        if hasattr(worker, "optimizer"):
            worker.optimizer.register_step_pre_hook(
                lambda optimizer, args, kwargs, model=worker.model: check(model, "optimizer step"))
        opened = worker.on_device

        def counted(opened=opened, name=name):
            PHASES[name] = PHASES.get(name, 0) + 1
            return opened()
        worker.on_device = counted
    gather = models.full_state_dict_items

    def checked_gather(model, *args, **kwargs):
        check(model, "weight gather")
        return gather(model, *args, **kwargs)
    models.full_state_dict_items = checked_gather


def local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def left_on_the_device(worker):
    """Offload everything to meta; the names of the tensors that stayed (none, when the offload is complete)."""
    models.OFFLOAD_DEVICE = torch.device("meta")
    worker.offload_params, worker.offload_optimizer = True, hasattr(worker, "optimizer")
    worker.offload()
    tensors = []
    for name, param in worker.model.named_parameters():
        tensors.append((f"parameter {name}", local(param)))
        if param.grad is not None:
            tensors.append((f"gradient of {name}", local(param.grad)))
    tensors += [(f"buffer {name}", buffer) for name, buffer in worker.model.named_buffers()]
    if hasattr(worker, "optimizer"):
        tensors += [(f"optimizer state {key}", local(value)) for state in worker.optimizer.state.values()
                    for key, value in state.items() if torch.is_tensor(value)]
    return [name for name, tensor in tensors if not tensor.is_meta]


def main(out_path, *overrides):
    cfg = load_config(Path(__file__).resolve().parents[1] / "config.yaml", list(overrides))
    watch_checkpoints()
    trainer = Trainer(cfg)
    workers = {name: worker for name, worker in (("actor", trainer.actor), ("ref", trainer.ref),
                                                  ("critic", trainer.critic), ("reward_model", trainer.reward_model))
               if isinstance(worker, models.Worker)}
    offloads = {name: [worker.offload_params, worker.offload_optimizer] for name, worker in workers.items()}
    watch_workers(workers)
    trainer.fit()
    gradients = {name: sum(p.grad is not None for p in worker.model.parameters()) for name, worker in workers.items()}
    report = {"uses_outside_a_phase": OUTSIDE, "phases": PHASES, "offloads": offloads, "gradients": gradients,
              "left_on_the_device": {name: left_on_the_device(worker) for name, worker in workers.items()}}
    if trainer.rank == 0:
        Path(out_path).write_text(json.dumps(report))
    trainer.tracker.close()
    torch.distributed.barrier()
    failures.leave(0)         # the models are on meta now: no engine shutdown, no teardown


if __name__ == "__main__":
    main(*sys.argv[1:])
