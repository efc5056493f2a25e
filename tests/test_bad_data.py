"""Bad data and faulty reward functions are caught with the dataset file and row named: before any model loads
where the data alone shows it (unknown or empty data_source, a missing reward_fn_key column, rows without a
ground truth), and at scoring time for what only the reward function shows (a raise, a non-finite or huge
score, a call that stalls)."""
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from data import RLHFDataset
from launch import ROOT, times_said, torchrun
from rewards import RewardFunctionError, check_rows, default_compute_score, score_responses
import rewards


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def demo_rows(n=4, **changes):
    """n rows of the demo task; changes = {row number: {column: value}}."""
    rows = [{"data_source": "minirl/add", "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}, "extra_info": {"index": i}}
            for i in range(n)]
    for row, columns in changes.items():
        rows[int(row)].update(columns)
    return rows


def dataset_rows(tmp_path, tokenizer, rows, name="train.parquet"):
    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows), path)
    dataset = RLHFDataset(path, tokenizer, max_prompt_length=64)
    return path, [(dataset.where(i), row) for i, row in enumerate(dataset.rows)]


def custom(needs_ground_truth=None):
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return float(len(solution_str))
    if needs_ground_truth is not None:
        compute_score.needs_ground_truth = needs_ground_truth
    return compute_score


# ---------------------------------------------------------------------------------------------------------------
# Before any model loads


@pytest.mark.parametrize("changes, key, message", [
    ({"2": {"data_source": "my/unknown"}}, "data_source", "row 2: no built-in reward for data_source='my/unknown'"),
    ({"1": {"data_source": None}}, "data_source", "row 1: column 'data_source' is empty"),
    ({}, "source", "row 0: data.reward_fn_key='source' names no column"),
    ({"3": {"reward_model": {"style": "rule", "ground_truth": None}}}, "data_source",
     "row 3: reward_model.ground_truth is missing"),
])
def test_rows_the_built_in_rewards_cannot_score_are_named(tmp_path, tokenizer, changes, key, message):
    path, rows = dataset_rows(tmp_path, tokenizer, demo_rows(**changes))
    with pytest.raises(ValueError) as info:
        check_rows(default_compute_score, rows, key)
    assert f"{path}, {message}" in str(info.value)


def test_answers_stored_as_bytes_are_named_for_the_built_in_rewards(tmp_path, tokenizer):
    """Found: a ground_truth column of bytes trained, every answer scored wrong (b'5' is not '5')."""
    as_bytes = [dict(row, reward_model={"style": "rule", "ground_truth": row["reward_model"]["ground_truth"].encode()})
                for row in demo_rows()]
    path, rows = dataset_rows(tmp_path, tokenizer, as_bytes)
    with pytest.raises(ValueError, match=re.escape(f"{path}, row 0: reward_model.ground_truth is bytes (b'")):
        check_rows(default_compute_score, rows)
    check_rows(custom(), rows)                                  # a custom function may take bytes


@pytest.mark.parametrize("answer, shown", [(5, "int (5)"), (5.0, "float (5.0)"), (float("nan"), "float (nan)")])
def test_answers_stored_as_numbers_are_named_for_the_built_in_rewards(tmp_path, tokenizer, answer, shown):
    """Found: a gsm8k file with int answers trained with every score 0 (72 is not '72'); a float column (pandas'
    int column with gaps) scored '5.0' against '5' as wrong."""
    as_numbers = [dict(row, reward_model={"style": "rule", "ground_truth": answer}) for row in demo_rows()]
    path, rows = dataset_rows(tmp_path, tokenizer, as_numbers)
    with pytest.raises(ValueError, match=re.escape(f"{path}, row 0: reward_model.ground_truth is {shown}, which")):
        check_rows(default_compute_score, rows)
    check_rows(custom(), rows)                                  # a custom function may take numbers


def test_a_good_file_passes_and_other_reward_fn_keys_work(tmp_path, tokenizer):
    _, rows = dataset_rows(tmp_path, tokenizer, demo_rows())
    check_rows(default_compute_score, rows)
    _, rows = dataset_rows(tmp_path, tokenizer, [dict(r, source="minirl/add") for r in demo_rows()])
    check_rows(default_compute_score, rows, "source")


def test_ground_truth_is_needed_unless_the_custom_function_declares_otherwise(tmp_path, tokenizer):
    no_truth = demo_rows(**{"1": {"reward_model": {"style": "model"}}, "2": {"data_source": "anything/goes"}})
    path, rows = dataset_rows(tmp_path, tokenizer, no_truth)
    check_rows(custom(needs_ground_truth=False), rows)          # custom: any data_source, no answers needed
    for fn in (custom(), custom(needs_ground_truth=True)):
        with pytest.raises(ValueError, match=re.escape(f"{path}, row 1: reward_model.ground_truth is missing")):
            check_rows(fn, rows)
    check_rows(None, rows)                                      # a reward model scores: the column is enough


def test_the_trainer_stops_before_loading_models(demo_dir, tmp_path):
    """Under torchrun on 2 ranks: an unknown data_source in the validation file stops the run with exit 2, the
    file and row named once (and in torchrun's Root Cause block), and no model was loaded."""
    rows = pq.read_table(demo_dir / "data" / "test.parquet").to_pylist()[:10]
    rows[7]["data_source"] = "my/unknown"
    val = tmp_path / "val.parquet"
    pq.write_table(pa.Table.from_pylist(rows), val)
    out = torchrun(2, "minirl.py", "--config", ROOT / "config.yaml", f"actor_rollout_ref.model.path={demo_dir}/model",
                   f"data.train_files={demo_dir}/data/train.parquet", f"data.val_files={val}",
                   f"af_output_dir={tmp_path}/out", expect_ok=False, timeout=120)
    assert out.returncode != 0, out.stderr[-3000:]         # torchrun exits 1 whatever its workers exit with
    message = f"error: {val}, row 7: no built-in reward for data_source='my/unknown'"
    # printed once by the rank that found it (not once per rank), and shown again in torchrun's closing report
    assert times_said(out.stderr, message) == 1, out.stderr[-3000:]
    assert f"traceback : {message}" in out.stderr
    assert "Loading weights" not in out.stderr + out.stdout


def test_a_validation_set_the_filter_empties_stops_the_run_before_models_load(demo_dir, tmp_path):
    """data.filter_overlong_prompts taking out every validation prompt once loaded the models, trained up to the
    first validation and died there in a StopIteration; now the run says what the filter dropped and stops."""
    val = tmp_path / "val.parquet"
    pq.write_table(pa.Table.from_pylist(demo_rows(3, **{str(i): {"prompt": [
        {"role": "user", "content": "What is " + " + ".join(["12"] * 40) + "?"}]} for i in range(3)})), val)
    out = torchrun(1, "minirl.py", "--config", ROOT / "config.yaml", f"actor_rollout_ref.model.path={demo_dir}/model",
                   f"data.train_files={demo_dir}/data/train.parquet", f"data.val_files={val}",
                   "data.filter_overlong_prompts=true", f"af_output_dir={tmp_path}/out", expect_ok=False, timeout=120)
    assert out.returncode != 0, out.stderr[-3000:]
    dropped = "filter_overlong_prompts dropped 3 of 3 prompts longer than max_prompt_length=64"
    assert f"data.val_files: {dropped}" in out.stdout
    assert times_said(out.stderr, f"error: data.val_files hold 0 prompts ({dropped}); raise "
                                  f"data.max_prompt_length") == 1, out.stderr[-3000:]
    assert "Loading weights" not in out.stderr + out.stdout


# ---------------------------------------------------------------------------------------------------------------
# At scoring time


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf"), 1e300, -2e6, "0.5", [1.0]])
def test_a_score_that_is_not_a_sane_finite_number_names_the_row(bad):
    origins = ["train.parquet, row 11", "train.parquet, row 12"]
    with pytest.raises(RewardFunctionError, match=r"bad result on train\.parquet, row 12 \(data_source='d2'"):
        score_responses(lambda **kw: 1.0 if kw["data_source"] == "d1" else bad, ["a", "b"], ["d1", "d2"], ["", ""],
                        None, origins)


def test_a_raising_reward_function_keeps_its_own_traceback():
    def broken(data_source, solution_str, ground_truth, extra_info=None):
        return {}["missing"]
    with pytest.raises(RewardFunctionError) as info:
        score_responses(broken, ["a"], ["d"], ["1"], None, ["val.parquet, row 5"])
    assert "reward function broken raised KeyError on val.parquet, row 5 (data_source='d'" in str(info.value)
    assert isinstance(info.value.shown_traceback, KeyError)
    assert info.value.shown_traceback.__traceback__.tb_next is not None     # down into broken()


def test_a_stalled_reward_call_is_reported_while_it_runs(monkeypatch, capfd):
    import time
    monkeypatch.setattr(rewards, "STALL_WARNING_S", 0.3)

    def slow_scorer(data_source, solution_str, ground_truth, extra_info=None):
        time.sleep(1.5 if solution_str == "slow" else 0.0)
        return 1.0
    scores, _ = score_responses(slow_scorer, ["fast", "slow", "fast"], ["d"] * 3, ["1"] * 3, None,
                                ["f.parquet, row 0", "f.parquet, row 1", "f.parquet, row 2"])
    assert scores == [1.0, 1.0, 1.0]
    err = capfd.readouterr().err
    assert err.count("warning: reward function slow_scorer has been running for over 0 s on f.parquet, row 1") == 1
    assert "row 0" not in err and "row 2" not in err


# ---------------------------------------------------------------------------------------------------------------
# Damaged parquet files: generated corruptions of a small good file either load (and every row can be used) or
# raise an error that names the file, nothing else


GOOD_ROWS = demo_rows(6)

corruption = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("overwrite"), st.floats(0, 1), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("insert"), st.floats(0, 1), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("flip"), st.floats(0, 1), st.integers(1, 255)),
)


def corrupt(data, corruptions):
    data = bytearray(data)
    for kind, where, *what in corruptions:
        at = int(where * max(len(data) - 1, 0))
        if kind == "truncate":
            del data[at:]
        elif kind == "overwrite":
            data[at:at + len(what[0])] = what[0]
        elif kind == "insert":
            data[at:at] = what[0]
        elif data:
            data[at] ^= what[0]
    return bytes(data)


@pytest.fixture(scope="module")
def good_parquet(tmp_path_factory):
    path = tmp_path_factory.mktemp("parquet") / "good.parquet"
    pq.write_table(pa.Table.from_pylist(GOOD_ROWS), path)
    return path.read_bytes(), path.with_name("damaged.parquet")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(corruptions=st.lists(corruption, min_size=1, max_size=3))
def test_a_damaged_parquet_loads_or_names_the_file(good_parquet, tokenizer, corruptions):
    data, path = good_parquet
    path.write_bytes(corrupt(data, corruptions))
    try:
        dataset = RLHFDataset(path, tokenizer, max_prompt_length=64, truncation="left")
        items = [dataset[i] for i in range(len(dataset))]
    except (ValueError, FileNotFoundError) as err:
        assert str(err).startswith((f"data file {path} ", f"{path}, ", f"{path}: ")), err
        return
    assert all(item["origin"].startswith(f"{path}, row ") for item in items)


def test_a_sound_file_with_a_duplicated_or_unreadable_column_names_the_column(tmp_path, tokenizer):
    """Both said the file was damaged and should be re-downloaded; the file is sound, one column is not."""
    rows = demo_rows()
    table = pa.Table.from_pylist(rows)
    duplicated = tmp_path / "dup.parquet"
    pq.write_table(table.append_column("data_source", table.column("data_source")), duplicated)
    with pytest.raises(ValueError, match=re.escape(f"data file {duplicated} has the column(s) ['data_source'] more "
                                                   f"than once; rename or drop the copies")):
        RLHFDataset(duplicated, tokenizer, max_prompt_length=64)
    not_utf8 = tmp_path / "utf8.parquet"
    bad = pa.array([b"\xff bad"] * len(rows), type=pa.binary()).view(pa.string())     # written without a check
    pq.write_table(table.append_column("note", bad), not_utf8)
    with pytest.raises(ValueError, match=re.escape(f"data file {not_utf8} holds text that is not UTF-8 in column "
                                                   f"'note' ('utf-8' codec can't decode byte 0xff")):
        RLHFDataset(not_utf8, tokenizer, max_prompt_length=64)


def test_a_folder_or_missing_path_is_named(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=f"data file {tmp_path} is not a regular file"):
        RLHFDataset(tmp_path, tokenizer, max_prompt_length=64)
    with pytest.raises(FileNotFoundError, match=f"data file {tmp_path / 'nope.parquet'} does not exist"):
        RLHFDataset(tmp_path / "nope.parquet", tokenizer, max_prompt_length=64)
