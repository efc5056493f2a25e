"""bench/lora.py runs (it once broke unnoticed when a helper it shares with bench/step.py changed) and measures
what it says: one variant's child process on the demo model, its sync bytes against counts from the config."""
import json
import subprocess
import sys

import pytest

from launch import ROOT, launch_env


def run_variant(model_dir, rank, targets, out):
    subprocess.run([sys.executable, str(ROOT / "bench" / "lora.py"), "--child", str(model_dir), str(rank), targets,
                    "1", str(out)], cwd=ROOT, env=launch_env(), check=True, capture_output=True, timeout=300)
    return json.loads(out.read_text())


@pytest.mark.parametrize("rank, targets", [(0, "all-linear"), (8, "[q_proj,v_proj]")])
def test_a_variant_reports_its_sync_bytes_step_time_and_memory(demo_dir, tmp_path, rank, targets):
    config = json.loads((demo_dir / "model" / "config.json").read_text())
    hidden, vocab, layers = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * hidden // config["num_attention_heads"]
    result = run_variant(demo_dir / "model", rank, targets, tmp_path / "result.json")
    if rank == 0:       # every parameter, and the tied LM head as a tensor of its own: fp32
        assert result["sync_bytes"] == 4 * (result["params"] + vocab * hidden)
        assert result["dummy_first_sync_extra_bytes"] == 0
    else:               # A [r, in] and B [out, r] on q_proj (hidden -> hidden) and v_proj (hidden -> kv)
        assert result["sync_bytes"] == 4 * layers * rank * ((hidden + hidden) + (hidden + kv))
        assert result["dummy_first_sync_extra_bytes"] > result["sync_bytes"]
    # the demo model is small beside the imports: its peak may be theirs
    assert result["step_s"] > 0 and result["peak_rss_mb"] >= result["steps_peak_rss_mb"] >= result["baseline_rss_mb"]
