"""Runs minirl for tests/test_offpolicy.py and records what it trained on, in one of two test-only ways:

    torchrun --nproc_per_node T+R tests/offpolicy_probe.py record OUT.pt key=value ...
        a split run (pass trainer.n_gpus_per_node / rollout.n_gpus_per_node; the hf engine's batches carry the
        log-probs of the tokens it sampled, under the policy that generated them). Trainer rank 0 writes OUT.pt: per
        step the batch it trained on and the actor's weights when it took the batch, and the final weights.
    torchrun --nproc_per_node 1 tests/offpolicy_probe.py replay RECORD.pt OUT.pt key=value ...
        a colocated run whose generation returns RECORD's batches, one per step, with the recorded run's trainer
        thread count; writes the final weights to OUT.pt
"""
import copy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import minirl  # noqa: E402
import offpolicy  # noqa: E402
from models import full_state_dict_items  # noqa: E402


def snapshot(model):
    return {name: tensor.clone() for name, tensor in full_state_dict_items(model)}


def sampled_logprobs(model, prompt_ids, responses, temperature):
    """log p(token) of each sampled token under `model` at `temperature`, one sequence at a time (no padding)."""
    out = []
    for prompt, response in zip(prompt_ids, responses):
        ids = torch.tensor([list(prompt) + list(response)])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist())
    return out


def record(out_path, *overrides):
    steps = []
    next_batch, close = offpolicy.Pipeline.next_batch, minirl.Trainer.close

    def recording_next_batch(self, timings):
        weights = snapshot(self.trainer.actor.model)          # the trainer's weights as it takes the batch
        batch = next_batch(self, timings)
        kept = {k: v.clone() if torch.is_tensor(v) else copy.deepcopy(v) for k, v in batch.items()}   # as taken
        steps.append({"step": self.trainer.global_step, "batch": kept, "weights": weights})
        return batch

    def recording_close(self):
        final = snapshot(self.actor.model)
        if self.rank == 0:
            torch.save({"steps": steps, "final": final, "threads": torch.get_num_threads()}, out_path)
        close(self)

    offpolicy.Pipeline.next_batch = recording_next_batch
    minirl.Trainer.close = recording_close
    return minirl.main(["--config", str(ROOT / "config.yaml"), *overrides])


def replay(record_path, out_path, *overrides):
    recorded = torch.load(record_path, weights_only=False)
    batches = [s["batch"] for s in recorded["steps"]]
    generate, close, init = minirl.Trainer.generate, minirl.Trainer.close, minirl.Trainer.__init__

    def init_with_the_recorded_threads(self, cfg):
        init(self, cfg)
        # CPU float sums depend on the thread count, and Adam turns that rounding into real steps on a mini-batch
        # whose exact gradient is 0 (README, Determinism): the update is bitwise equal at the same count only
        torch.set_num_threads(recorded["threads"])

    def replaying_generate(self, batch, sampling, purpose):
        if purpose != "train":
            return generate(self, batch, sampling, purpose)
        return dict(batches[self.global_step - 1])

    def recording_close(self):
        final = snapshot(self.actor.model)
        if self.rank == 0:
            torch.save({"final": final}, out_path)
        close(self)

    minirl.Trainer.generate = replaying_generate
    minirl.Trainer.__init__ = init_with_the_recorded_threads
    minirl.Trainer.close = recording_close
    return minirl.main(["--config", str(ROOT / "config.yaml"), *overrides])


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    sys.exit({"record": record, "replay": replay}[mode](*args))
