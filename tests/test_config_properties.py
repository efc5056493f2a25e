"""Property tests (hypothesis): override sets generated from the real key table (its types, its ranges, yaml's
special strings) either load with every value of its type and in range, or raise ConfigError; nothing else."""
import math
import re

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from config import ConfigError, get_dotted, load_config
from config_keys import SCHEMA, leaves
from test_config import minimal, write

YAML_SPECIAL = ["{{", "}", "]", "[", ":", "- a", "!x 1", "!!int abc", "!!python/name:os.system", "*a", "&a [*a]",
                "&a x", "'x", '"x', "null", "~", "", "yes", "off", "0x1f", "0o17", "1_000", "1e400", "-1e400", ".nan",
                "-.inf", "2001-12-14", "[1, [2]]", "{a: 1}", "[[[[[[[[]]]]]]]]", "a: b", "%TAG", "@x", "`x", "|",
                ">", "#", "? x", "\t", "\x00", "\ud7ff", "é", "1" * 400]
KEYS = [(dotted, spec) for dotted, spec in leaves(SCHEMA) if spec.kinds is not dict]

# Written here, independently of config_keys' interval notation: the ranges that keep a run from going wrong.
MUST_HOLD = {
    "actor_rollout_ref.rollout.temperature": lambda v: v > 0,
    "actor_rollout_ref.rollout.top_p": lambda v: 0 < v <= 1,
    "actor_rollout_ref.rollout.top_k": lambda v: v >= -1,           # -1 and 0 (verl's value for HF): every token
    "actor_rollout_ref.rollout.n": lambda v: v >= 1,
    "actor_rollout_ref.rollout.gpu_memory_utilization": lambda v: 0 < v <= 1,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": lambda v: v >= 1,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": lambda v: v is None or v >= 1,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": lambda v: v is None or v >= 1,
    "actor_rollout_ref.actor.optim.lr": lambda v: v > 0,
    "actor_rollout_ref.actor.optim.betas": lambda v: len(v) == 2 and all(0 <= b < 1 for b in v),
    "actor_rollout_ref.actor.grad_clip": lambda v: v > 0,
    "algorithm.gamma": lambda v: 0 <= v <= 1,
    "algorithm.lam": lambda v: 0 <= v <= 1,
    "trainer.total_epochs": lambda v: v >= 1,
    "trainer.total_training_steps": lambda v: v is None or v >= 1,
    "trainer.seed": lambda v: 0 <= v < 2 ** 32,
    "data.seed": lambda v: 0 <= v < 2 ** 32,
    "data.train_batch_size": lambda v: v >= 1,
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq
    root = tmp_path_factory.mktemp("props")
    (root / "model").mkdir()
    pq.write_table(pa.table({"data_source": ["x"] * 8}), root / "train.parquet")
    paths = {"model": str(root / "model"), "train": str(root / "train.parquet"),
             "val": str(root / "train.parquet"), "dir": root}
    return write(paths, minimal(paths))


def _yaml_text(value):
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else {math.inf: ".inf", -math.inf: "-.inf"}.get(value, ".nan")
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(_yaml_text(item) for item in value) + "]"
    return "null" if value is None else str(value)


def _values_for(spec):
    kinds = spec.kinds if isinstance(spec.kinds, tuple) else (spec.kinds,)
    numbers = st.one_of(st.integers(-3, 3), st.integers(-2 ** 40, 2 ** 40), st.sampled_from([4294967295, 4294967296]),
                        st.floats(allow_nan=True, allow_infinity=True), st.floats(-1.5, 1.5))
    options = [st.sampled_from(YAML_SPECIAL), st.none(), st.booleans(), numbers.map(_yaml_text),
               st.just(spec.default).map(_yaml_text)]
    if spec.valid and re.search(r"\d", spec.valid):        # both sides of each bound of the declared range
        bounds = [float(b) for b in re.findall(r"-?\d+(?:\.\d+)?", spec.valid)]
        near = [v for b in bounds for v in (b, b - 1, b + 1, b / 2, b + 0.5, b - 0.001)]
        options += [st.sampled_from(near).map(lambda v: _yaml_text(int(v) if spec.kinds is int else v))] * 3
    if str in kinds:
        options.append(st.text(max_size=20))
    if any(isinstance(kind, list) for kind in kinds) or spec.kinds in ([float], [int]):
        options.append(st.lists(st.one_of(numbers, st.text(max_size=5)), max_size=3).map(_yaml_text))
    return st.one_of(*options).map(lambda v: v if isinstance(v, str) else _yaml_text(v))


@st.composite
def override_sets(draw):
    critical = [(dotted, spec) for dotted, spec in KEYS if dotted in MUST_HOLD]    # drawn as often as all others
    chosen = draw(st.lists(st.one_of(st.sampled_from(KEYS), st.sampled_from(critical)), min_size=1, max_size=2,
                           unique_by=lambda item: item[0]))
    prefix = draw(st.sampled_from(["", "+", "backend_config."]))
    return [f"{prefix}{dotted}={draw(_values_for(spec))}" for dotted, spec in chosen]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(overrides=override_sets())
def test_generated_overrides_load_in_range_or_raise_config_error(base, overrides):
    try:
        cfg = load_config(base, overrides, world_size=2)
    except ConfigError:
        return
    for dotted, spec in KEYS:
        value = get_dotted(cfg, dotted)
        for number in value if isinstance(value, list) else [value]:
            if isinstance(number, float):
                assert math.isfinite(number), (dotted, value)
    for dotted, holds in MUST_HOLD.items():
        assert holds(get_dotted(cfg, dotted)), (dotted, get_dotted(cfg, dotted), overrides)
    assert all(isinstance(name, str) for name in cfg.trainer.logger)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.one_of(st.text(max_size=300), st.lists(st.sampled_from(YAML_SPECIAL + ["data:", "  x: 1", "trainer:",
                                                                                   "  seed: 3", "\n"]),
                                                      max_size=12).map("\n".join)))
def test_generated_config_files_load_or_raise_config_error(tmp_path, text):
    path = tmp_path / "generated.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        load_config(path, [], check_paths=False)
    except ConfigError:
        pass


NAMES = sorted({part for dotted, _ in leaves(SCHEMA) for part in dotted.split(".")}
               | {"backend_config", "engine_kwargs", "vllm", "_target_"})
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True), st.text(max_size=8))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(tree={"engine_kwargs": {"vllm": {}}, "actor_rollout_ref": 3})   # once a traceback
@given(tree=st.dictionaries(st.sampled_from(["af_output_dir", "backend_config", "engine_kwargs", *SCHEMA]),
                            st.recursive(SCALARS, lambda inner: st.one_of(
                                st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(NAMES), inner, max_size=4)),
                                max_leaves=20), max_size=5))
def test_generated_trees_of_real_key_names_load_or_raise_config_error(tmp_path, tree):
    """Shapes: real key names at wrong depths, sections holding scalars or lists, engine_kwargs anywhere."""
    path = tmp_path / "tree.yaml"
    path.write_text(yaml.safe_dump(tree))
    try:
        load_config(path, [], check_paths=False)
    except ConfigError:
        pass
