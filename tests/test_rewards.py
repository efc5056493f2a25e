"""Tests for rewards.py and math_grader.py: every expected score below is worked out by hand from verl's rules
(see the comments).

Run: HF_HUB_OFFLINE=1 .venv/bin/python -m pytest tests/test_rewards.py -q
"""
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import math_grader as grader  # noqa: E402
from config_keys import ConfigError  # noqa: E402
from math_grader import geo3k_extract_boxed, geo3k_grade_answer, math_normalize, minerva_normalize  # noqa: E402
from rewards import (  # noqa: E402
    check_reward_signature, check_rows, default_compute_score, geo3k_compute_score, gsm8k_compute_score,
    gsm8k_extract_solution, load_reward_fn, math_compute_score, math_dapo_compute_score, math_last_boxed_answer,
    minirl_add_compute_score,
    RewardFunctionError, overlong_penalties, score_batch, score_in_processes, score_responses, token_level_scores)


# --------------------------------------------------------------------------------------------- gsm8k

@pytest.mark.parametrize("text, strict, flexible", [
    ("3 + 4 = 7\n#### 7", "7", "7"),
    ("#### 1,234", "1234", "1,234"),            # strict strips commas, flexible keeps them
    ("#### $18", None, "18"),                   # the strict capture cannot start with "$"
    ("####7", None, "7"),                       # strict needs exactly "#### "
    ("#### 3 then #### 5", "5", "5"),           # last match wins
    ("#### -2.5", "-2.5", "-2.5"),
    ("The answer is 42.", None, "42."),         # flexible keeps the sentence's full stop: verl's quirk
    ("Hmm. Ok.", None, "."),                    # only "." tokens: verl's loop ends on the first one
    ("Hello, world", None, ","),                # "," is number-like and not in verl's invalid list
    ("no digits here", None, None),
])
def test_gsm8k_extract(text, strict, flexible):
    assert gsm8k_extract_solution(text, "strict") == strict
    assert gsm8k_extract_solution(text, "flexible") == flexible


def test_gsm8k_only_last_300_characters_count():
    inside = "#### 7" + "x" * 294    # 6 + 294 = 300 characters: the whole string is the tail
    outside = "#### 7" + "x" * 295   # 301 characters: the tail starts at "### 7", so no "#### "
    assert gsm8k_extract_solution(inside) == "7"
    assert gsm8k_extract_solution(outside) is None
    assert gsm8k_extract_solution(outside, "flexible") == "7"    # the 7 itself is still inside the tail
    early = "8 " + "x" * 300         # the 8 is 302 characters from the end: out of the tail
    assert gsm8k_extract_solution(early, "flexible") is None


def test_gsm8k_compute_score():
    assert gsm8k_compute_score("#### 7", "7") == 1.0
    assert gsm8k_compute_score("#### 8", "7") == 0.0                         # format_score defaults to 0
    assert gsm8k_compute_score("#### 8", "7", format_score=0.1) == 0.1
    assert gsm8k_compute_score("no answer", "7", format_score=0.1) == 0.0    # no answer: 0 whatever format_score
    assert gsm8k_compute_score("the answer is 7", "7", method="flexible") == 1.0
    assert gsm8k_compute_score("Hmm. Ok.", "7", method="flexible", format_score=0.5) == 0.5  # "." is an answer
    assert gsm8k_compute_score("#### 1,000", "1000", score=2.0) == 2.0
    with pytest.raises(ValueError, match="strict"):
        gsm8k_extract_solution("#### 7", "loose")


# --------------------------------------------------------------------------------------------- MATH

@pytest.mark.parametrize("text, answer", [
    ("so \\boxed{3} and then \\boxed{4}.", "4"),                       # the last box
    ("\\boxed{\\frac{\\sqrt{3}}{2}} done", "\\frac{\\sqrt{3}}{2}"),      # nested braces stay balanced
    ("The answer is $\\boxed 5$.", "5"),                               # "\boxed " runs to the next "$"
    ("$\\boxed 3$ and later \\boxed{4}", "3"),                         # "\boxed " wins over a later \boxed{}
    ("\\fbox{5}", None),                                               # found by verl, then rejected
    ("\\boxed{5", None),                                               # unbalanced
    ("no box", None),
])
def test_math_last_boxed_answer(text, answer):
    assert math_last_boxed_answer(text) == answer


@pytest.mark.parametrize("raw, normal", [
    ("\\dfrac{3}{4}", "\\frac{3}{4}"),
    ("\\frac12", "\\frac{1}{2}"),
    ("\\frac1{72}", "\\frac{1}{72}"),
    ("\\frac12+\\frac3", "\\frac12+\\frac3"),          # one character after a \frac: nothing is fixed
    ("\\sqrt3", "\\sqrt{3}"),
    ("\\left( 1, 2 \\right)", "(1,2)"),
    ("10\\text{ inches}", "10"),
    ("90^\\circ", "90"),
    ("50\\%", "50"),
    ("k = 5", "5"),                                  # "k " has 2 characters: the left side goes
    ("ab = 5", "ab=5"),                              # "ab " has 3: kept
    (".5", "\\frac{1}{2}"),                          # ".5" -> "0.5" -> \frac{1}{2}
    ("3/4", "\\frac{3}{4}"),
    ("03/4", "03/4"),                                # not written canonically: left alone
    ("\\$ 5", "5"),
])
def test_math_normalize(raw, normal):
    assert math_normalize(raw) == normal


@pytest.mark.parametrize("text, truth, score", [
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0),
    ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
    ("\\boxed{3} then \\boxed{4}", "4", 1.0),
    ("\\boxed{3} then \\boxed{4}", "3", 0.0),
    ("\\boxed{3}", "4", 0.0),
    ("no box, the answer is 4", "4", 0.0),
    ("\\fbox{4}", "4", 0.0),
    ("\\boxed{2\\sqrt}", "2\\sqrt", 1.0),     # \sqrt at the end cannot be normalised: raw strings compared
    ("\\boxed{2\\sqrt}", "2 \\sqrt", 0.0),    # ... and these raw strings differ
    ("\\boxed{5\\text{ m}\\text{ s}}", "5", 0.0),   # two "\text{ " units: not normalisable, raw differs
])
def test_math_compute_score(text, truth, score):
    assert math_compute_score(text, truth) == score


# --------------------------------------------------------------------------------------------- geo3k

def test_geo3k_extract_boxed():
    assert geo3k_extract_boxed("x \\boxed{1} y \\boxed{ \\frac{1}{2} } z") == "\\frac{1}{2}"
    assert geo3k_extract_boxed("\\boxed{5") is None
    assert geo3k_extract_boxed("5") is None


@pytest.mark.parametrize("given, truth, correct", [
    ("2\\sqrt{3}", "2\\sqrt{3}", True),
    ("\\sqrt{48}", "4\\sqrt{3}", True),          # 48 = 16·3
    ("\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}\\sqrt{3}", True),
    ("2\\pi", "\\pi \\cdot 2", True),
    ("3.0", "3", True),
    ("1,000", "1000", True),
    ("60^\\circ", "60", True),
    ("5 \\text{cm}", "5", True),
    ("x = 7.5", "7.5", True),
    ("\\frac{80}{6}", "\\frac{40}{3}", False),  # unreduced fraction: mathruler refuses it
    ("13.33", "\\frac{40}{3}", False),
    ("\\sqrt{4}", "2", False),                  # integer ground truth needs an integer answer
    ("4", "5", False),
    ("9^{99999}", "1", False),                  # exponent guard, and an integer truth anyway
    (None, "5", False),
])
def test_geo3k_grade_answer(given, truth, correct):
    assert geo3k_grade_answer(given, truth) is correct


def test_geo3k_arithmetic_with_and_without_sympy():
    # sqrt(12) = 2·sqrt(3): exact with sympy, within 1e-9 with floats
    assert grader._arithmetic_equal("\\sqrt{12}", "2\\sqrt{3}", use_sympy=True)
    assert grader._arithmetic_equal("\\sqrt{12}", "2\\sqrt{3}", use_sympy=False)
    assert not grader._arithmetic_equal("\\sqrt{12}", "3\\sqrt{2}", use_sympy=False)    # 3.46 vs 4.24
    assert grader._arithmetic_equal("x+1", "1+x", use_sympy=True)
    assert not grader._arithmetic_equal("x+1", "1+x", use_sympy=False)                  # variables need sympy
    assert not grader._arithmetic_equal("2^{1000}", "2^{1000}", use_sympy=True)         # exponent > 100 refused
    assert grader._arithmetic_equal("(2^{99})^{2}", "4^{99}", use_sympy=True)           # 2^198 ~ 4e59: allowed
    assert not grader._arithmetic_equal("(2^{99})^{99}", "(2^{99})^{99}", use_sympy=True)  # 2^9801 > 1e300: refused
    assert grader._arithmetic_equal("x^{2}", "x \\cdot x", use_sympy=True)             # a symbolic base is fine


def test_geo3k_never_evaluates_arbitrary_code():
    assert grader._latex_to_arithmetic("__import__('os').system('true')") is None
    assert grader._latex_to_arithmetic("abc") is None           # 3 variables: more than mathruler allows
    assert grader._latex_to_arithmetic("\\alpha") is None       # untranslated LaTeX
    assert grader._latex_to_arithmetic("\\frac{a^{2}}{3}") == "((a**(2))/(3))"


@pytest.mark.parametrize("text, truth, score", [
    ("<think>r</think> so \\boxed{2\\sqrt{3}}", "2\\sqrt{3}", 1.0),     # 0.9·1 + 0.1·1
    ("<think>\nline\n</think>\nthus \\boxed{5}\n", "5", 1.0),          # DOTALL: newlines allowed
    ("\\boxed{5}", "5", 0.9),                                          # 0.9·1 + 0.1·0: no <think>
    ("ok <think>a</think> \\boxed{5}", "5", 0.9),                      # must start with <think>
    ("\\boxed{5}<think>a</think>", "5", 0.9),                          # box before the think block
    ("<think>a</think> \\boxed{4}", "5", 0.1),                         # 0.9·0 + 0.1·1
    ("<think>a</think> 5", "5", 0.0),                                  # no box: neither
])
def test_geo3k_compute_score(text, truth, score):
    assert geo3k_compute_score(text, truth) == pytest.approx(score, abs=1e-12)


# --------------------------------------------------------------------------------------------- demo task

@pytest.mark.parametrize("text, truth, score", [
    ("3+4=7\n#### 7", "7", 1.0),
    ("3+4=7\n#### 7", 7, 1.0),              # an int ground truth is compared as its string
    ("#### 8", "7", 0.1),                   # a strict answer, wrong
    ("#### 7 no wait #### 8", "7", 0.1),    # the last one counts
    ("the sum is 7", "7", 0.0),             # no strict answer
    ("#### 7" + "x" * 295, "7", 0.0),       # the answer is beyond the last 300 characters
])
def test_minirl_add(text, truth, score):
    assert minirl_add_compute_score(text, truth) == score


# --------------------------------------------------------------------------------------------- DAPO's math (Minerva)

@pytest.mark.parametrize("raw, normal", [
    ("1,000", "1000"),                                  # spaces go, then an integer's commas
    ("1,000.5", "1,000.5"),                             # ...only an integer's
    ("x = 3", "3"),                                     # the part after the last "="
    ("$\\frac{1}{2}$", "\\frac{1}{2}"),                 # the first $...$ span, then no "$"
    ("\\frac12", "\\frac{1}{2}"),                       # \fracab -> \frac{a}{b}
    ("\\sqrt3", "\\sqrt{3}"),
    ("\\boxed{7}", "7"),
    ("\\text{(B)}", "(B)"),
    ("5 degrees", "5"), ("12 students", "12"), ("90^\\circ", "90"),
    ("Panama ", "Panam"),                               # "a " is removed wherever it is, as in verl's
    ("  7  ", "7"),
])
def test_minerva_normalize(raw, normal):
    assert minerva_normalize(raw) == normal


@pytest.mark.parametrize("text, truth, right, pred", [
    ("so it is 5.\nAnswer: 5", "5", True, "5"),
    ("answer : 1,000 dollars", "1000", True, "1000"),     # case-insensitive, units and commas dropped
    ("Answer: 4\nthen Answer: 6", "6", True, "6"),       # the last one
    ("Answer: 4", "5", False, "4"),
    ("no answer line", "5", False, "[INVALID]"),
    ("Answer: 5" + " padding" * 50, "5", False, "[INVALID]"),   # only the last 300 characters are read
    ("Answer: 5\n" + "x" * 290, "5", True, "5"),               # 300 characters: all read
    ("Answer: 5\n" + "x" * 291, "5", False, "[INVALID]"),      # 301: the "A" is cut off
])
def test_math_dapo_compute_score(text, truth, right, pred):
    assert math_dapo_compute_score(text, truth) == {"score": 1.0 if right else -1.0, "acc": right, "pred": pred}


def test_math_dapo_sources_dispatch_to_a_dict_and_pass_the_row_check():
    """verl's default_compute_score: data_source math_dapo or any aime* (AIME 2024 in DAPO's scripts) -> the dict."""
    def row(source):
        return [("f, row 0", {"data_source": source, "reward_model": {"ground_truth": "7"}})]

    for source in ("math_dapo", "aime2024", "aime_2025"):
        assert default_compute_score(source, "Answer: 7", "7") == {"score": 1.0, "acc": True, "pred": "7"}
        check_rows(default_compute_score, row(source))
    with pytest.raises(ValueError, match=r"no built-in reward for data_source='math'; built-in: .*'aime\*'"):
        check_rows(default_compute_score, row("math"))


# --------------------------------------------------------------------------------------------- dispatch

@pytest.mark.parametrize("source, text, truth, score", [
    ("openai/gsm8k", "#### 7", "7", 1.0),
    ("openai/gsm8k", "nothing", "7", 0.0),
    ("lighteval/MATH", "\\boxed{7}", "7", 1.0),
    ("DigitalLearningGmbH/MATH-lighteval", "\\boxed{7}", "7", 1.0),
    ("HuggingFaceH4/MATH-500", "\\boxed{0.5}", "\\frac12", 1.0),
    ("hiyouga/geometry3k", "\\boxed{7}", "7", 0.9),
    ("minirl/add", "#### 8", "7", 0.1),
])
def test_default_compute_score_dispatch(source, text, truth, score):
    result = default_compute_score(source, text, truth, extra_info={"index": 0})
    assert type(result) is float and result == pytest.approx(score, abs=1e-12)


def test_default_compute_score_unknown_source():
    with pytest.raises(NotImplementedError) as info:
        default_compute_score("my/data", "x", "y")
    message = str(info.value)
    assert "my/data" in message and "openai/gsm8k" in message and "custom_reward_function.path" in message


# --------------------------------------------------------------------------------------------- custom functions

CUSTOM = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": len(solution_str), "length": len(solution_str)}

def exact(data_source, solution_str, ground_truth, extra_info=None):
    return solution_str == ground_truth
'''


def test_load_reward_fn(tmp_path):
    assert load_reward_fn(None) is default_compute_score
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    assert load_reward_fn(str(path))("d", "abc", "x") == {"score": 3, "length": 3}
    assert load_reward_fn(str(path), "exact")("d", "x", "x") is True


def test_load_reward_fn_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="custom_reward_function.path"):
        load_reward_fn(str(tmp_path / "missing.py"))
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    with pytest.raises(ConfigError, match=r"custom_reward_function.name='nope'.*\['compute_score', 'exact'\]"):
        load_reward_fn(str(path), "nope")
    data = tmp_path / "train.parquet"
    data.write_bytes(b"PAR1")
    with pytest.raises(ConfigError, match=r"custom_reward_function.path='.*train.parquet' is not a Python file"):
        load_reward_fn(str(data))
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ImportError, match="broken.py"):
        load_reward_fn(str(broken))


def test_a_reward_function_that_cannot_take_its_managers_arguments_is_named_before_loading():
    """Found by fuzzing: compute_score(solution_str, ground_truth) failed only at the first scoring, after the models
    had loaded and generated."""
    def verl_style(data_source, solution_str, ground_truth, extra_info=None):
        return 0.0

    def two_args(solution_str, ground_truth):
        return 0.0

    def batch_style(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0):
        return []

    for manager in ("naive", "dapo", "prime"):
        check_reward_signature(verl_style, manager, {})
        with pytest.raises(ConfigError, match=rf"two_args\(solution_str, ground_truth\) cannot take what "
                                              rf"reward_model.reward_manager={manager} passes \(data_source, "):
            check_reward_signature(two_args, manager, {})
    check_reward_signature(batch_style, "batch", {"scale": 2.0})
    with pytest.raises(ConfigError, match=r"reward_manager=batch passes .*unexpected keyword argument 'bonus'"):
        check_reward_signature(batch_style, "batch", {"bonus": 1})
    with pytest.raises(ConfigError, match=r"verl_style.*reward_manager=batch passes"):
        check_reward_signature(verl_style, "batch", {})


# --------------------------------------------------------------------------------------------- batch scoring

def test_score_responses_numbers_and_dicts(tmp_path):
    scores, extras = score_responses(default_compute_score, ["#### 7", "\\boxed{3}"],
                                     ["openai/gsm8k", "lighteval/MATH"], ["7", "4"], [None, None])
    assert scores == [1.0, 0.0] and extras == [{}, {}]
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    scores, extras = score_responses(load_reward_fn(str(path)), ["ab", "abcd"], ["d", "d"], ["", ""])
    # every key of a dict result, "score" too (verl's reward managers append them all to reward_extra_info)
    assert scores == [2.0, 4.0] and extras == [{"score": 2, "length": 2}, {"score": 4, "length": 4}]


def test_score_responses_accepts_bools_and_tensors():
    results = iter([True, torch.tensor(0.25)])
    scores, _ = score_responses(lambda **kw: next(results), ["a", "b"], ["d", "d"], ["", ""])
    assert scores == [1.0, 0.25]


def test_score_responses_names_the_failing_row():
    def picky(data_source, solution_str, ground_truth, extra_info=None):
        return 1 / 0 if data_source == "dsB" else 1.0
    long_response = "A" * 100 + "B" * 100
    with pytest.raises(RuntimeError) as info:
        score_responses(picky, ["ok", long_response], ["dsA", "dsB"], ["", ""], [None, None])
    message = str(info.value)
    assert "row 1" in message and "data_source='dsB'" in message
    assert "AAAA ... BBBB" in message and "A" * 61 not in message    # a short excerpt, start and end
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_score_responses_unknown_source_is_not_a_silent_zero():
    with pytest.raises(RuntimeError, match="row 0.*my/data") as info:
        score_responses(default_compute_score, ["x"], ["my/data"], ["y"], [None])
    assert isinstance(info.value.__cause__, NotImplementedError)


@pytest.mark.parametrize("bad", [float("nan"), math.inf, "1", None, {"acc": 1.0}, torch.tensor([1.0, 2.0])])
def test_score_responses_rejects_bad_scores(bad):
    with pytest.raises(RuntimeError, match="row 1.*data_source='d2'"):
        score_responses(lambda **kw: 1.0 if kw["data_source"] == "d1" else bad, ["a", "b"], ["d1", "d2"], ["", ""])


def test_a_dict_value_that_cannot_be_pickled_names_the_row_and_the_key():
    """Validation gathers a dict result's extra keys over the ranks (pickled): a value that cannot travel is named
    when it is returned, not in the gather's traceback."""
    import threading
    results = iter([{"score": 1.0, "pred": "7"}, {"score": 0.0, "pred": "8", "lock": threading.Lock()}])
    with pytest.raises(RuntimeError, match=r"row 1.*data_source='d2'.*'lock' holds a lock, which cannot be sent"):
        score_responses(lambda **kw: next(results), ["a", "b"], ["d1", "d2"], ["", ""])


def test_score_responses_length_mismatch():
    with pytest.raises(ValueError, match="different lengths 2/1/2/2"):
        score_responses(default_compute_score, ["a", "b"], ["d"], ["", ""])


def test_score_batch_calls_once_with_lists_and_the_kwargs():
    """reward_manager=batch, verl's BatchRewardManager: fn(data_sources=, solution_strs=, ground_truths=,
    extra_infos=, **reward_kwargs) once; its per-row results are checked as one row's are."""
    calls = []

    def longest_wins(data_sources, solution_strs, ground_truths, extra_infos, bonus):
        calls.append((data_sources, solution_strs, ground_truths, extra_infos))
        longest = max(map(len, solution_strs))
        return [{"score": float(len(s) == longest) + bonus, "longest": longest} for s in solution_strs]

    scores, extras = score_batch(longest_wins, ["ab", "abcd", "abc"], ["d"] * 3, ["1", "2", "3"],
                                 [None, {"i": 1}, None], ["row 0", "row 1", "row 2"], {"bonus": 0.5})
    assert calls == [(["d"] * 3, ["ab", "abcd", "abc"], ["1", "2", "3"], [None, {"i": 1}, None])]
    assert scores == [0.5, 1.5, 0.5] and extras[1] == {"score": 1.5, "longest": 4}
    with pytest.raises(RewardFunctionError, match=r"returned 2 for the batch of 3 responses \(row 0 .. row 2\): it "
                                                  r"must return one score"):
        score_batch(lambda **kw: [1.0, 2.0], ["a", "b", "c"], ["d"] * 3, ["1"] * 3, [None] * 3,
                    ["row 0", "row 1", "row 2"], {})
    with pytest.raises(RewardFunctionError, match=r"returned a bad result for row 1 \(data_source='d', "
                                                  r"response='b'\): score is nan"):
        score_batch(lambda **kw: [1.0, float("nan")], ["a", "b"], ["d"] * 2, ["1"] * 2, [None] * 2,
                    ["row 0", "row 1"], {})
    with pytest.raises(RewardFunctionError, match=r"raised KeyError on the batch of 1 responses"):
        score_batch(lambda **kw: {}["x"], ["a"], ["d"], ["1"], [None], ["row 0"], {})


SANDBOXED = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "loop":                 # a program that never ends
        while True:
            pass
    if solution_str == "crash":
        raise RuntimeError("sandbox crashed")
    if solution_str == "tuple":
        return 0.75, "details"
    if solution_str == "dict":
        return {"score": 0.5, "passed": 3}
    return float(len(solution_str)) if ground_truth == "len" else 0.25
"""


def test_prime_scores_in_processes_and_turns_failures_and_timeouts_into_zero(tmp_path, capsys):
    """reward_manager=prime (verl's PrimeRewardManager): each response scored in a forked process pool, a call that
    raises or runs past the timeout scores 0.0 with a warning naming the row, a tuple counts by its first element,
    and no process outlives the call (the endless loop's included). The function comes from a file, as
    custom_reward_function loads it: it need not be picklable (the workers inherit it)."""
    import multiprocessing
    path = tmp_path / "sandboxed.py"
    path.write_text(SANDBOXED)
    texts = ["ab", "loop", "crash", "tuple", "dict", "abcd"]
    scores, extras = score_in_processes(load_reward_fn(str(path)), texts, ["code"] * 6, ["len"] * 6, [None] * 6,
                                        [f"row {i}" for i in range(6)], timeout_s=3)
    assert scores == [2.0, 0.0, 0.0, 0.75, 0.5, 4.0]
    assert extras[4] == {"score": 0.5, "passed": 3} and extras[0] == {}
    warnings = capsys.readouterr().err
    assert "(reward_manager=prime) ran past 3 s on row 1; scored 0.0" in warnings
    assert "raised RuntimeError: sandbox crashed on row 2; scored 0.0" in warnings
    assert not [child for child in multiprocessing.active_children() if child.is_alive()]


def test_overlong_penalties_by_hand():
    """DAPO's ramp: max_resp_len 10, buffer 4: up to 6 tokens free, then -1/4 per token (x penalty_factor)."""
    assert overlong_penalties([3, 6, 7, 8, 10], 10, 4, 1.0) == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalties([7, 10], 10, 4, 0.5) == [-0.125, -0.5]
    assert overlong_penalties([1, 10], 10, 10, 1.0) == [-0.1, -1.0]          # the whole response is the buffer


# --------------------------------------------------------------------------------------------- token placement

def test_token_level_scores_placement():
    mask = torch.tensor([[1, 1, 1, 0, 0],     # length 3 -> column 2
                         [1, 1, 1, 1, 1],     # length 5 -> column 4
                         [1, 0, 0, 0, 0],     # length 1 -> column 0
                         [0, 0, 0, 0, 0]])    # length 0 -> index -1 -> column 4, as verl
    scores = torch.tensor([0.5, -1.0, 2.0, 3.0], dtype=torch.float64)
    expected = torch.tensor([[0.0, 0.0, 0.5, 0.0, 0.0],
                             [0.0, 0.0, 0.0, 0.0, -1.0],
                             [2.0, 0.0, 0.0, 0.0, 0.0],
                             [0.0, 0.0, 0.0, 0.0, 3.0]])
    out = token_level_scores(scores, mask)
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)
    assert torch.equal(token_level_scores(scores, mask.bool()), expected)


def test_token_level_scores_shape_errors():
    with pytest.raises(ValueError, match=r"\(3,\) and \(2, 4\)"):
        token_level_scores(torch.zeros(3), torch.ones(2, 4))
