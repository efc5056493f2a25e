"""Malformed config input never reaches a traceback, and every number is checked against the range declared
beside its default: each case below is a ConfigError naming the override or file, the key, the value and the fix."""
import subprocess
import sys
import time
from pathlib import Path

import pytest

from config import ConfigError, load_config
from config_keys import DEFAULTS, _as_keys, leaves
from test_config import minimal, paths, write  # noqa: F401,F811  (paths is a fixture)

ROOT = Path(__file__).resolve().parents[1]


def load(paths, *overrides):
    return load_config(write(paths, minimal(paths)), list(overrides), world_size=2)


@pytest.mark.parametrize("override, pattern", [
    ("af_output_dir={{", r"override 'af_output_dir=\{\{' is not valid yaml: .* at line 1, column 3"),
    ("trainer.logger=!x 1", r"override 'trainer.logger=!x 1': yaml tags \(!x\) are not accepted"),
    ("data.train_batch_size=!!int abc", r"yaml tags \(!!int\) are not accepted"),
    ("af_output_dir=!", r"override 'af_output_dir=!': yaml tags \(!\) are not accepted"),   # a bare '!' (fuzzing)
    ('data.prompt_key="unterminated', r"override 'data.prompt_key=\"unterminated' is not valid yaml"),
    ("data.prompt_key=]", r"override 'data.prompt_key=\]' is not valid yaml"),
    ("data.prompt_key=:", r"override 'data.prompt_key=:' is not valid yaml"),
    ("data.prompt_key=*nope", r"override 'data.prompt_key=\*nope' is not valid yaml: found undefined alias 'nope'"),
    ("data.prompt_key=&a [*a]", r"override 'data.prompt_key=&a \[\*a\]': a value contains itself"),
    ("data.prompt_key=" + "[" * 2000, r"nested deeper than 32 levels"),
    ("data.train_files=[[1]]", r"'data.train_files' must be str or a list of str, got \[\[1\]\]"),
    ("data.train_files=[a.parquet, 3]", r"'data.train_files' must be str or a list of str"),
    ("data.train_files=/" + "a" * 300, r"'data.train_files': path '/a+\.\.\.' cannot be used: File name too long"),
    ("data.train_files=/dev/null", r"'data.train_files': '/dev/null' is not a file"),
    ("data.train_files=[/tmp]", r"'data.train_files': '/tmp' is not a file"),      # a folder is no parquet file
    ("backend_config=8", r"override 'backend_config=8': 'backend_config' must be a mapping"),
    ("trainer=3", r"config key 'trainer' .* must be a mapping of keys, got 3"),
    ("a..b=3", r"override 'a..b=3' has a malformed key 'a..b'"),
    ("~trainer.seed", r"deleting a key \(~key\) is not supported"),
    ("data.prompt_key", r"override 'data.prompt_key' must look like key.path=value \(e.g. [^)]*\)$"),
    ("my_run.yaml", r"must look like key.path=value .*; a config file goes after --config \(--config my_run.yaml\)"),
    ("x" * 70000 + "=1", r"characters long; the most is 65536"),
])
def test_malformed_override_is_a_config_error(paths, override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load(paths, override)


def _bomb():
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("content, pattern", [
    (bytes(range(256)) * 4, r"is not a text file \(binary, or UTF-16\)"),
    ("data:\n  train_batch_size: 8\n".encode("utf-16"), r"is not a text file \(binary, or UTF-16\)"),
    ("trainer:\n  project_name: caf\xe9\n".encode("latin-1"), r"is not UTF-8 text \(bad byte at offset 28\)"),
    (b"# " + b"x" * (2 << 20), r"is 2097154 bytes; a config is at most 1048576"),
    ("".join("  " * i + f"k{i}:\n" for i in range(200)), r"nested deeper than 32 levels"),
    ("a: " + "[" * 100000, r"nested deeper than 32 levels"),
    (_bomb(), r"more than 100000 values once its aliases are expanded \(an alias bomb\?\)"),
    ("".join(f"a{i}: &a{i} [{f'*a{i - 1}' if i else 'x'}]\n" for i in range(100)), r"nested deeper than 32 levels"),
    ("data: &a\n  x: *a\n", r"a value contains itself \(an alias to its own anchor\) at 'data.x'"),
    ("data: !!python/object/apply:os.system ['echo hi']\n", r"yaml tags \(!!python/object/apply:os.system\)"),
    ("data:\n  1: 2\n", r"key 1 \(int\) at 'data' is not a name"),
    ("trainer:\n  yes: 2\n", r"key True \(bool\) at 'trainer' is not a name"),
    ("? [a, b]\n: 1\n", r"line 1 has a mapping whose key is a list; config keys are names"),
    ("# data:\n#   train_batch_size: 8\n", r"holds no keys \(it is empty, or comments only\)"),
    ("- a\n- b\n", r"the top level must be a mapping of keys, got list"),
    ("backend_config: 8\n", r"'backend_config' must be a mapping of verl's sections, got 8"),
    ("data:\n  train_batch_size: [1, 2\n", r"is not valid yaml: expected ',' or '\]'.* at line 3, column 1"),
    ("data:\n\ttrain_batch_size: 8\n", r"at line 2, column 1; indent with spaces \(yaml does not allow tabs\)"),
    ("data:\n  train_batch_size: 16\n  max_prompt_length: 8\n  train_batch_size: 32\n",
     r"key 'train_batch_size' is written twice in one mapping \(lines 2 and 4\); keep one"),
    ("data:\n  train_files: a.parquet\ntrainer:\n  seed: 1\ndata:\n  val_files: b.parquet\n",
     r"key 'data' is written twice in one mapping \(lines 1 and 5\)"),
])
def test_malformed_config_file_is_a_config_error_naming_it(paths, content, pattern):
    path = paths["dir"] / "bad.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    started = time.monotonic()
    with pytest.raises(ConfigError, match=rf"config file '{path}'.*{pattern}|{pattern}") as err:
        load_config(path, [], check_paths=False)
    assert str(path) in str(err.value)
    assert time.monotonic() - started < 5      # bounded before parsing: no hang on bombs or huge files


@pytest.mark.parametrize("path", ["/dev/null", "/" + "a" * 300 + ".yaml", "."])
def test_config_path_that_is_no_file(path):
    with pytest.raises(ConfigError, match="config file '.*' (does not exist or is not a regular file|cannot be read)"):
        load_config(path)


@pytest.mark.parametrize("override, pattern", [
    # a Jinja template unquoted is a yaml flow mapping whose key is a mapping (it was a TypeError traceback)
    ("actor_rollout_ref.model.custom_chat_template={{ bos_token }}", r"whose key is a dict; .* must be quoted"),
    ("actor_rollout_ref.rollout.temperature=0", r"temperature'=0 is out of range: valid is \(0, inf\) \(log-probs"),
    ("actor_rollout_ref.actor.optim.lr=1e400", r"'actor_rollout_ref.actor.optim.lr'=inf is not a finite number"),
    ("actor_rollout_ref.actor.optim.lr=-1e-6", r"lr'=-1e-06 is out of range: valid is \(0, inf\)"),
    ("actor_rollout_ref.actor.optim.lr=.nan", r"lr'=nan is not a finite number"),
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=-1", r"per_gpu'=-1 is out of range: valid is \[1, inf\)"),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=0", r"per_gpu'=0 is out of range"),
    ("actor_rollout_ref.actor.grad_clip=-1", r"grad_clip'=-1 is out of range: valid is \(0, inf\)"),
    ("trainer.total_training_steps=-5", r"total_training_steps'=-5 is out of range: valid is \[1, inf\)"),
    ("trainer.total_epochs=0", r"total_epochs'=0 is out of range"),
    ("actor_rollout_ref.rollout.top_p=5", r"top_p'=5 is out of range: valid is \(0, 1\]"),
    ("actor_rollout_ref.rollout.top_k=-2", r"top_k'=-2 is out of range: valid is -1 or \[0, inf\) \(-1 or 0 for "
                                           r"all tokens"),
    ("algorithm.gamma=.nan", r"'algorithm.gamma'=nan is not a finite number"),
    ("algorithm.lam=1.5", r"'algorithm.lam'=1.5 is out of range: valid is \[0, 1\]"),
    ("actor_rollout_ref.rollout.n=0", r"'actor_rollout_ref.rollout.n'=0 is out of range"),
    ("data.seed=-1", r"'data.seed'=-1 is out of range: valid is \[0, 4294967296\)"),
    ("trainer.seed=4294967296", r"'trainer.seed'=4294967296 is out of range"),
    ("actor_rollout_ref.rollout.gpu_memory_utilization=1.5", r"gpu_memory_utilization'=1.5 is out of range: valid is \(0, 1\]"),
    ("actor_rollout_ref.actor.optim.betas=[0.9,1.0]", r"betas'=\[0.9, 1.0\] is out of range: valid is \[0, 1\)"),
    ("actor_rollout_ref.actor.optim.betas=[0.9]", r"betas' must hold two numbers"),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=0", r"tensor_model_parallel_size'=0 is out of range"),
    ("data.train_batch_size=0", r"'data.train_batch_size'=0 is out of range: valid is \[1, inf\); default is 1024"),
    ("actor_rollout_ref.actor.clip_ratio_c=1", r"clip_ratio_c'=1 is out of range: valid is \(1, inf\)"),
])
def test_out_of_range_names_key_value_and_range(paths, override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load(paths, override)


@pytest.mark.parametrize("override", [
    "actor_rollout_ref.rollout.val_kwargs.temperature=0",       # greedy validation, as verl
    "actor_rollout_ref.rollout.top_k=-1", "actor_rollout_ref.rollout.top_p=1", "trainer.seed=4294967295",
    "actor_rollout_ref.actor.optim.lr=1e-6", "trainer.save_freq=-1", "trainer.total_training_steps=null",
])
def test_boundary_values_inside_the_range_load(paths, override):
    load(paths, override)


def test_every_numeric_key_minirl_reads_declares_its_range():
    """Ranges are declared for every number in minirl's table (verl-only keys, which change nothing, may go
    without)."""
    missing = [dotted for dotted, spec in leaves(_as_keys(DEFAULTS)) if spec.valid is None
               and spec.kinds in (int, float, (int, float), [float], [int])]
    assert missing == []


def test_cli_prints_one_config_error_line_and_exits_2(paths):
    bad = paths["dir"] / "bomb.yaml"
    bad.write_text(_bomb())
    good = str(write(paths, minimal(paths)))
    # the last two with --print-config: the error alone, not after the config tree (found: the tree came first)
    for argv in (["--config", str(bad)], ["--config", good, "af_output_dir={{"],
                 ["--config", good, "--print-config", "data.train_batch_size=15"],
                 ["--config", good, "--print-config", "af_output_dir=hdfs://nn/out"]):
        out = subprocess.run([sys.executable, str(ROOT / "minirl.py"), *argv], capture_output=True, text=True,
                             cwd=ROOT, timeout=300)
        assert out.returncode == 2
        assert out.stderr.startswith("config error: ") and "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and out.stdout == ""
