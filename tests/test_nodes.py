"""Several nodes with torchrun, tested as two "nodes" on localhost: two torchrun processes (--nnodes 2, --node_rank
0/1, one process each, gloo) train 2 GRPO steps with trainer.nnodes=2; rank 0 of the world alone writes metrics; the
checkpoint (on a filesystem both nodes see) is then resumed by a 1-node x 2-process run."""
import json
import socket
import subprocess
import sys

from launch import ROOT, assert_resumed, launch_env, torchrun_cmd


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def overrides(demo_dir, out, steps, *extra):
    return [f"actor_rollout_ref.model.path={demo_dir}/model", f"data.train_files={demo_dir}/data/train.parquet",
            "data.val_files=null", f"af_output_dir={out}", f"trainer.total_training_steps={steps}",
            "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.logger=[console]",
            "data.train_batch_size=4", "data.max_response_length=8", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "trainer.save_freq=2", *extra]


def metric_steps(out):
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_two_nodes_on_localhost_train_and_one_node_resumes(demo_dir, tmp_path):
    out, port = tmp_path / "run", free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank",
                               str(rank), "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port",
                               str(port), "minirl.py", "--config", str(ROOT / "config.yaml"),
                               *overrides(demo_dir, out, 2, "trainer.nnodes=2", "trainer.n_gpus_per_node=1")],
                              cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    logs = [node.communicate(timeout=900)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert metric_steps(out) == [1, 2]                                   # one row per step: world rank 0 only
    actor = out / "checkpoints" / "global_step_2" / "actor"
    assert {p.name for p in actor.glob("model_world_size_2_rank_*.pt")} == {"model_world_size_2_rank_0.pt",
                                                                           "model_world_size_2_rank_1.pt"}

    resumed = subprocess.run(torchrun_cmd(2, "minirl.py", "--config", ROOT / "config.yaml",
                                          *overrides(demo_dir, out, 3)),
                             cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert_resumed(resumed, 2)
    assert metric_steps(out) == [1, 2, 3]
