"""Rule-based rewards with verl's semantics (verl/utils/reward_score + NaiveRewardManager).

What it does: turns a decoded response and a ground truth into a scalar score, per data_source, exactly as verl's
`default_compute_score` would for the sources minirl supports, and places that score on the last valid response
token. Usage:

    fn = load_reward_fn(cfg.custom_reward_function.path, cfg.custom_reward_function.name)  # None -> built-ins
    check_rows(fn, [(where, row), ...])               # before any model loads: every row can be scored
    scores, extras = score_responses(fn, responses, data_sources, ground_truths, extra_infos, origins)
    token_scores = token_level_scores(torch.tensor(scores), response_mask)               # [B, R]

Built-in data sources (see SCORERS): openai/gsm8k, the three MATH names, hiyouga/geometry3k, DAPO's math_dapo and
aime* (a dict: score +-1, acc, pred) and the demo tasks minirl/add and minirl/colour. Any scorer takes
(data_source, solution_str, ground_truth, extra_info=None), the signature verl uses for `custom_reward_function`,
and returns a number or a dict holding "score" (finite, |score| <= MAX_ABS_SCORE). A custom function that scores
without answers says so with `compute_score.needs_ground_truth = False`.
The answer comparisons (verl's MATH normal form, Minerva's, our stand-in for mathruler's grader) live in
math_grader.py.
"""
import importlib.util
import inspect
import math
import multiprocessing
import os
import pickle
import re
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import wait as futures_wait
from contextlib import contextmanager

import torch

from config_keys import ConfigError
from failures import ReportedError
from math_grader import geo3k_extract_boxed, geo3k_grade_answer, math_is_equiv, minerva_normalize


# ---------------------------------------------------------------------------------------------------------------
# gsm8k (verl/utils/reward_score/gsm8k.py)

GSM8K_CLIP_CHARS = 300  # only the tail of a response is searched, so an early "#### 5" in a long answer is ignored
_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_GSM8K_NUMBER_LIKE = re.compile(r"(\-?[0-9\.\,]+)")


def gsm8k_extract_solution(solution_str, method="strict"):
    """The answer string in the last 300 characters, or None.

    strict: the last "#### <number>" (exactly one space after ####), with "," and "$" removed. The capture cannot
        hold a "$", so "#### $18" has no strict answer.
    flexible: the last number-like token (digits, ".", "," and a leading "-", commas kept) other than ".". As in
        verl, a tail whose only tokens are "." returns "." (never equal to a ground truth, but not None either).
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', not {method!r}")
    tail = solution_str[-GSM8K_CLIP_CHARS:]
    if method == "strict":
        answers = _GSM8K_STRICT.findall(tail)
        return answers[-1].replace(",", "").replace("$", "") if answers else None
    tokens = _GSM8K_NUMBER_LIKE.findall(tail)
    if not tokens:
        return None
    real_numbers = [t for t in tokens if t not in ("", ".")]
    return real_numbers[-1] if real_numbers else tokens[0]


def gsm8k_compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    """0 without an answer, `score` if the answer string equals ground_truth, else `format_score`."""
    answer = gsm8k_extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score


# ---------------------------------------------------------------------------------------------------------------
# MATH (verl/utils/reward_score/math.py): the last \boxed{} answer, compared in MATH normal form (math_grader.py)

def math_last_boxed_answer(solution_str):
    """The content of the last \\boxed{...} (brace-balanced), or None.

    verl's quirks, kept on purpose: if "\\boxed " (with a space) occurs anywhere it wins, and the answer is the text
    after its last occurrence up to the next "$"; a \\fbox{...} is located but then rejected, so it never scores.
    """
    if "\\boxed " in solution_str:
        return solution_str.split("\\boxed ")[-1].split("$")[0]
    start = solution_str.rfind("\\boxed")
    if start < 0:
        return None
    depth = 0
    for end in range(start, len(solution_str)):
        if solution_str[end] == "{":
            depth += 1
        elif solution_str[end] == "}":
            depth -= 1
            if depth == 0:
                boxed = solution_str[start:end + 1]
                return boxed[len("\\boxed{"):-1] if boxed.startswith("\\boxed{") else None
    return None


def math_compute_score(solution_str, ground_truth):
    """1.0 if the last boxed answer is equivalent to ground_truth, else 0.0."""
    answer = math_last_boxed_answer(solution_str)
    return 1.0 if answer is not None and math_is_equiv(answer, ground_truth) else 0.0


# ---------------------------------------------------------------------------------------------------------------
# geo3k (verl/utils/reward_score/geo3k.py): 0.9·accuracy + 0.1·format; the grading is our stand-in for
# mathruler's, in math_grader.py

_GEO3K_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def geo3k_format_ok(solution_str):
    """<think>...</think> followed somewhere by \\boxed{...}, matched over the whole string."""
    return _GEO3K_FORMAT.fullmatch(solution_str) is not None


def geo3k_compute_score(solution_str, ground_truth, use_boxed=True, format_score=0.1):
    """(1 - format_score)·acc + format_score·fmt, i.e. 0.9·acc + 0.1·fmt. acc grades the \\boxed{} content, or
    with use_boxed=False the whole string (verl's Geo3kTool grades the answer it is handed)."""
    answer = geo3k_extract_boxed(solution_str) if use_boxed else solution_str
    accuracy = 1.0 if geo3k_grade_answer(answer, ground_truth) else 0.0
    formatted = 1.0 if geo3k_format_ok(solution_str) else 0.0
    return (1.0 - format_score) * accuracy + format_score * formatted


# ---------------------------------------------------------------------------------------------------------------
# DAPO's math (verl/utils/reward_score/math_dapo.py, DAPO-Math-17k's data_source "math_dapo", and "aime*"): the last
# "Answer: ..." line, compared in Minerva's normal form (math_grader.py); +1 right, -1 wrong, as a dict

MATH_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
MATH_DAPO_TAIL_CHARS = 300          # only the response's end is read (MATH-500's longest answer has 159 characters)


def math_dapo_compute_score(solution_str, ground_truth):
    """{"score": 1.0 or -1.0, "acc": bool, "pred": the normalised answer}: right when the last "Answer: X" in the
    response's last 300 characters equals ground_truth in Minerva's normal form; without one the answer is
    "[INVALID]"."""
    answers = MATH_DAPO_ANSWER.findall(solution_str[-MATH_DAPO_TAIL_CHARS:])
    pred = minerva_normalize(answers[-1] if answers else "[INVALID]")
    right = pred == minerva_normalize(str(ground_truth))
    return {"score": 1.0 if right else -1.0, "acc": right, "pred": pred}


# ---------------------------------------------------------------------------------------------------------------
# the demo task: add two numbers, answer as "#### N"

def minirl_add_compute_score(solution_str, ground_truth):
    """1.0 for a correct strict "#### N", 0.1 for a wrong one, 0.0 without one (gsm8k strict extraction)."""
    return gsm8k_compute_score(solution_str, str(ground_truth), method="strict", format_score=0.1, score=1.0)


_COLOUR_ANSWER = re.compile(r"#### ([a-z]+)")


def minirl_colour_compute_score(solution_str, ground_truth):
    """The vision demo (which colour is the square?): 1.0 for the right "#### colour", 0.1 for another word after
    "####", 0.0 without one. The last answer counts."""
    answers = _COLOUR_ANSWER.findall(solution_str)
    if not answers:
        return 0.0
    return 1.0 if answers[-1] == str(ground_truth) else 0.1


# ---------------------------------------------------------------------------------------------------------------
# dispatch, loading, batch scoring

SCORERS = {
    "openai/gsm8k": gsm8k_compute_score,
    "lighteval/MATH": math_compute_score,
    "DigitalLearningGmbH/MATH-lighteval": math_compute_score,
    "HuggingFaceH4/MATH-500": math_compute_score,
    "hiyouga/geometry3k": geo3k_compute_score,
    "minirl/add": minirl_add_compute_score,
    "minirl/colour": minirl_colour_compute_score,
    "minirl/box": minirl_add_compute_score,      # the tool demo (demo_tools.py): the same "#### N" rule
    "math_dapo": math_dapo_compute_score,
}
SCORER_PREFIXES = {"aime": math_dapo_compute_score}      # verl: data_source.startswith("aime")
BUILT_IN = sorted(SCORERS) + [f"{prefix}*" for prefix in SCORER_PREFIXES]


def scorer_of(data_source):
    """The built-in scorer for a data source, or None."""
    if data_source in SCORERS:
        return SCORERS[data_source]
    return next((fn for prefix, fn in SCORER_PREFIXES.items() if str(data_source).startswith(prefix)), None)


def default_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's default_compute_score for the sources in SCORERS and SCORER_PREFIXES: a float, or a scorer's dict
    (math_dapo's) as it is."""
    scorer = scorer_of(data_source)
    if scorer is None:
        raise NotImplementedError(
            f"no built-in reward for data_source={data_source!r}; known: {BUILT_IN}. Write "
            f"compute_score(data_source, solution_str, ground_truth, extra_info=None) in a .py file and set "
            f"custom_reward_function.path (and custom_reward_function.name if the function has another name)")
    result = scorer(solution_str, ground_truth)
    return result if isinstance(result, dict) else float(result)


def load_reward_fn(path=None, name="compute_score"):
    """default_compute_score when path is None, else function `name` from the python file at `path`."""
    if path is None:
        return default_compute_score
    if not os.path.isfile(path):
        raise FileNotFoundError(f"custom_reward_function.path={path!r} is not a file; point it at a .py file "
                                f"defining {name}(data_source, solution_str, ground_truth, extra_info=None)")
    spec = importlib.util.spec_from_file_location("minirl_custom_reward", path)
    if spec is None:                                  # not a name Python imports (no .py)
        raise ConfigError(f"custom_reward_function.path={path!r} is not a Python file; point it at a .py file "
                          f"defining {name}(data_source, solution_str, ground_truth, extra_info=None)")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        raise ImportError(f"importing custom_reward_function.path={path!r} failed: {error!r}") from error
    fn = getattr(module, name, None)
    if not callable(fn):
        available = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ConfigError(f"custom_reward_function.name={name!r} is not a function in {path!r}; functions "
                          f"there: {available}")
    return fn


def check_reward_signature(fn, reward_manager, reward_kwargs):
    """Before any model loads: a custom reward function takes the arguments its reward manager will pass (else the
    first call, after generation, would fail): keywords data_source, solution_str, ground_truth, extra_info (naive,
    dapo), the same four positionally (prime), or the batch's lists and reward_kwargs (batch)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):              # a builtin or C function: nothing to read
        return
    keywords = ("data_source", "solution_str", "ground_truth", "extra_info")
    try:
        if reward_manager == "batch":
            signature.bind(data_sources=[], solution_strs=[], ground_truths=[], extra_infos=[], **reward_kwargs)
        elif reward_manager == "prime":
            signature.bind(*keywords)
        else:
            signature.bind(**dict.fromkeys(keywords))
    except TypeError as err:
        wanted = ("data_sources, solution_strs, ground_truths, extra_infos (keywords), plus reward_kwargs"
                  if reward_manager == "batch" else ", ".join(keywords))
        raise ConfigError(f"custom_reward_function {getattr(fn, '__name__', fn)}{signature} cannot take what "
                          f"reward_model.reward_manager={reward_manager} passes ({wanted}): {err}") from None


def _excerpt(text, width=120):
    """The start and end of a long response (the answer usually sits at the end)."""
    if len(text) <= width:
        return text
    return text[:width // 2] + " ... " + text[-width // 2:]


MAX_ABS_SCORE = 1e6       # a larger reward is a bug (1e300 would turn into inf advantages and NaN losses)
STALL_WARNING_S = 10.0    # one reward call running longer than this is reported while it runs


class RewardFunctionError(ReportedError):
    """A reward function raised or returned something that is not a score. The run shows the function's own
    traceback (shown_traceback) once, then this summary naming the dataset file, row and data_source."""

    def __init__(self, message, cause=None):
        super().__init__(message)
        self.shown_traceback = cause


def needs_ground_truth(fn):
    """Whether `fn` needs each row's reward_model.ground_truth. The built-in scorers do; a custom function
    declares that it does not with an attribute: `compute_score.needs_ground_truth = False`."""
    return getattr(fn, "needs_ground_truth", True)


def check_rows(fn, rows, reward_fn_key="data_source"):
    """Before any model loads: every row's `reward_fn_key` value names a data source `fn` can score and, unless fn
    declares otherwise, the row has a ground truth (for the built-in rewards, text: not bytes, not a number).
    rows: [(where, row dict)], where = "file, row N"; fn None (a reward model scores) checks the column only.
    Raises ValueError naming the first bad row and the fix."""
    for where, row in rows:
        if reward_fn_key not in row:
            raise ValueError(f"{where}: data.reward_fn_key={reward_fn_key!r} names no column of this file "
                             f"(columns: {sorted(row)}); set data.reward_fn_key to the column holding the data "
                             f"source")
        source = row[reward_fn_key]
        if source is None or source == "":
            raise ValueError(f"{where}: column {reward_fn_key!r} is empty; every row needs a data source (it "
                             f"selects the reward function)")
        if fn is None:
            continue
        if fn is default_compute_score and scorer_of(source) is None:
            raise ValueError(f"{where}: no built-in reward for {reward_fn_key}={source!r}; built-in: "
                             f"{BUILT_IN}. Write compute_score(data_source, solution_str, ground_truth, "
                             f"extra_info=None) in a .py file and set custom_reward_function.path")
        truth = (row.get("reward_model") or {}).get("ground_truth")
        if needs_ground_truth(fn) and (truth is None or truth == ""):
            raise ValueError(f"{where}: reward_model.ground_truth is missing (data_source={source!r}), so the rule "
                             f"reward could only score the format; add the answers to the data, or use a custom "
                             f"reward function that declares `compute_score.needs_ground_truth = False`")
        if fn is default_compute_score and not isinstance(truth, str):
            # b'5' is not '5', 72 is not '72', and 5.0 (what pandas makes of an int column with gaps) is not '5'
            shown = _excerpt(repr(truth), 40)
            raise ValueError(f"{where}: reward_model.ground_truth is {type(truth).__name__} ({shown}), which the "
                             f"built-in rewards, comparing text, would score wrong; store the answers as strings")


@contextmanager
def stall_warnings(fn_name, limit_s=None):
    """Yields a dict to fill with {"where": ..., "since": time.monotonic()} before each call (None after it); a
    watcher thread prints a warning naming the function and the row when one call runs past limit_s."""
    limit_s = STALL_WARNING_S if limit_s is None else limit_s
    current, done = {"where": None, "since": 0.0}, threading.Event()

    def watch():
        warned = None
        while not done.wait(min(1.0, limit_s)):
            where, since = current["where"], current["since"]
            if where is not None and where != warned and time.monotonic() - since > limit_s:
                print(f"warning: reward function {fn_name} has been running for over {limit_s:.0f} s on {where}",
                      file=sys.stderr, flush=True)
                warned = where

    watcher = threading.Thread(target=watch, name="minirl-reward-stall-watch", daemon=True)
    watcher.start()
    try:
        yield current
    finally:
        done.set()
        watcher.join()


def _score_and_extra(result):
    """(float score, extra dict) from a scorer result: a number/bool or a dict holding "score"."""
    extra = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"a dict result must contain 'score'; got keys {sorted(result)}")
        extra = dict(result)       # "score" too, as verl's reward managers keep it (before any overlong penalty)
        result = result["score"]
        for key, value in extra.items():          # validation gathers the extras over the ranks, pickled
            try:
                pickle.dumps(value)
            except Exception as error:
                raise ValueError(f"the dict's {key!r} holds a {type(value).__name__}, which cannot be sent between "
                                 f"ranks ({type(error).__name__}: {error}); return numbers, strings, or lists and "
                                 f"dicts of them") from error
    try:
        score = float(result) if hasattr(result, "__float__") else None  # a str has no __float__: "1" is refused
    except (TypeError, ValueError, RuntimeError):  # e.g. a tensor with several elements
        score = None
    if score is None:
        raise ValueError(f"score must be a number, a bool or a dict with 'score'; got {type(result).__name__} "
                         f"{result!r:.80}")
    if not math.isfinite(score) or abs(score) > MAX_ABS_SCORE:
        raise ValueError(f"score is {score}; it must be a finite number of magnitude at most {MAX_ABS_SCORE:g}")
    return score, extra


def score_responses(fn, responses, data_sources, ground_truths, extra_infos=None, origins=None):
    """Score every row with fn; returns (scores: list[float], extras: list[dict]).

    fn is called with keywords, as verl's NaiveRewardManager does. extras[i] holds a dict result's keys, "score"
    among them (verl's reward_extra_info; {} for a plain number). origins[i] ("file, row N" of the dataset) names
    a row in errors and stall warnings. Any failure raises RewardFunctionError naming the row instead of producing
    a silent wrong score.
    """
    if extra_infos is None:
        extra_infos = [None] * len(responses)
    if origins is None:
        origins = [f"row {row} of the batch" for row in range(len(responses))]
    lengths = {len(responses), len(data_sources), len(ground_truths), len(extra_infos), len(origins)}
    if len(lengths) != 1:
        raise ValueError(f"responses/data_sources/ground_truths/extra_infos/origins have different lengths "
                         f"{len(responses)}/{len(data_sources)}/{len(ground_truths)}/{len(extra_infos)}/"
                         f"{len(origins)}")
    name = getattr(fn, "__name__", repr(fn))
    scores, extras = [], []
    with stall_warnings(name) as current:
        for response, source, truth, info, origin in zip(responses, data_sources, ground_truths, extra_infos,
                                                         origins):
            where = f"{origin} (data_source={source!r}, response={_excerpt(response)!r})"
            current.update(where=where, since=time.monotonic())
            try:
                result = fn(data_source=source, solution_str=response, ground_truth=truth, extra_info=info)
            except Exception as error:
                raise RewardFunctionError(f"reward function {name} raised {type(error).__name__} on {where}: "
                                          f"{error}", cause=error) from error
            current["where"] = None
            try:
                score, extra = _score_and_extra(result)
            except ValueError as error:
                raise RewardFunctionError(f"reward function {name} returned a bad result on {where}: {error}") \
                    from error
            scores.append(score)
            extras.append(extra)
    return scores, extras


def score_batch(fn, responses, data_sources, ground_truths, extra_infos, origins, reward_kwargs):
    """reward_manager=batch (verl's BatchRewardManager): one call for the whole batch,
    fn(data_sources=[...], solution_strs=[...], ground_truths=[...], extra_infos=[...], **reward_kwargs), returning
    one number or dict per row (a batched reward: an LLM judge, scores relative to the batch). Returns (scores,
    extras) as score_responses does; a failure raises RewardFunctionError naming the batch or the row."""
    name = getattr(fn, "__name__", repr(fn))
    where = f"the batch of {len(responses)} responses ({origins[0]} .. {origins[-1]})" if origins else "an empty batch"
    with stall_warnings(name) as current:
        current.update(where=where, since=time.monotonic())
        try:
            results = fn(data_sources=list(data_sources), solution_strs=list(responses),
                         ground_truths=list(ground_truths), extra_infos=list(extra_infos), **reward_kwargs)
        except Exception as error:
            raise RewardFunctionError(f"reward function {name} (reward_manager=batch) raised "
                                      f"{type(error).__name__} on {where}: {error}", cause=error) from error
        current["where"] = None
    try:
        results = list(results)
    except TypeError:
        results = None
    if results is None or len(results) != len(responses):
        raise RewardFunctionError(f"reward function {name} (reward_manager=batch) returned "
                                  f"{'a ' + type(results).__name__ if results is None else len(results)} "
                                  f"for {where}: it must return one score (a number or a dict with 'score') per "
                                  f"response, in order")
    return _checked_results(results, f"{name} (reward_manager=batch)", origins, data_sources, responses)


def _checked_results(results, who, origins, data_sources, responses):
    """(scores, extras) of a manager's per-row results (_score_and_extra each), or RewardFunctionError naming the
    row whose result is not a score."""
    scores, extras = [], []
    for result, origin, source, response in zip(results, origins, data_sources, responses):
        try:
            score, extra = _score_and_extra(result)
        except ValueError as error:
            raise RewardFunctionError(f"reward function {who} returned a bad result for {origin} "
                                      f"(data_source={source!r}, response={_excerpt(response)!r}): {error}") from error
        scores.append(score)
        extras.append(extra)
    return scores, extras


PRIME_TIMEOUT_S = 300.0         # verl's PrimeRewardManager: a response's scoring is given up after this long
PRIME_MAX_WORKERS = 64          # ... in a pool of up to this many processes (a stuck call holds one up)
_prime_fn = None                # the function the pool's forked workers call: inherited, so it need not pickle


def _call_prime_fn(*args):
    return _prime_fn(*args)


def score_in_processes(fn, responses, data_sources, ground_truths, extra_infos, origins, timeout_s=PRIME_TIMEOUT_S):
    """reward_manager=prime (verl's PrimeRewardManager, for rewards that run untrusted code): every response is
    scored in a pool of forked processes, fn(data_source, solution_str, ground_truth, extra_info) positionally, all
    within timeout_s of the start; a call that raises or runs out of time scores 0.0 (a warning names the row)
    instead of stopping the run, and the pool's processes are killed afterwards, so a response stuck in a loop is
    stopped too. A list or tuple result counts by its first element (verl's rule). Returns (scores, extras)."""
    global _prime_fn
    name = getattr(fn, "__name__", repr(fn))
    workers = max(1, min(PRIME_MAX_WORKERS, len(responses)))
    _prime_fn = fn
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("fork"))
    try:
        futures = [pool.submit(_call_prime_fn, source, response, truth, info)
                   for response, source, truth, info in zip(responses, data_sources, ground_truths, extra_infos)]
        futures_wait(futures, timeout=timeout_s)
        results = []
        for future, origin in zip(futures, origins):
            if not future.done():
                failure = f"ran past {timeout_s:g} s"
            elif future.exception() is not None:
                failure = f"raised {type(future.exception()).__name__}: {future.exception()}"
            else:
                results.append(future.result())
                continue
            print(f"warning: reward function {name} (reward_manager=prime) {failure} on {origin}; scored 0.0",
                  file=sys.stderr, flush=True)
            results.append(0.0)
    finally:
        for process in list(getattr(pool, "_processes", {}).values()):     # the workers, stuck ones included
            process.kill()
        pool.shutdown(wait=True, cancel_futures=True)       # the pool then reaps them (it finds them dead)
        _prime_fn = None
    results = [result[0] if isinstance(result, (list, tuple)) and result else result for result in results]
    return _checked_results(results, f"{name} (reward_manager=prime)", origins, data_sources, responses)


def overlong_penalties(response_lengths, max_resp_len, buffer_len, penalty_factor):
    """DAPO's soft overlong punishment (verl's DAPORewardManager, reward_model.reward_manager=dapo): a response of
    L tokens longer than max_resp_len - buffer_len gets penalty_factor x (L - (max_resp_len - buffer_len)) /
    buffer_len subtracted, from 0 at the buffer's start down to -penalty_factor at max_resp_len; shorter ones 0.

        penalty(L) = min(-(L - (max_resp_len - buffer_len)) / buffer_len * penalty_factor, 0)
    """
    expected = max_resp_len - buffer_len
    return [min(-(length - expected) / buffer_len * penalty_factor, 0.0) for length in response_lengths]


def add_overlong_penalty(scores, extras, response_lengths, reward_kwargs):
    """reward_manager=dapo: the scores with overlong_penalties added when reward_kwargs.overlong_buffer_cfg.enable
    (reward_kwargs: config.dapo_reward_arguments, checked there); with its `log`, each row's extras also get the
    penalty and whether it applied (verl's reward_extra_info "overlong_reward" and "overlong")."""
    buffer = reward_kwargs["overlong_buffer_cfg"]
    if not buffer["enable"]:
        return scores
    penalties = overlong_penalties(response_lengths, reward_kwargs["max_resp_len"], buffer["len"],
                                   buffer["penalty_factor"])
    if buffer["log"]:
        for extra, penalty in zip(extras, penalties):
            extra.update(overlong_reward=penalty, overlong=penalty < 0)
    return [score + penalty for score, penalty in zip(scores, penalties)]


def token_level_scores(scores, response_mask):
    """[B] scores -> [B, R] float32 tensor holding each score at its row's last valid response token.

    The index is response_mask.sum(-1) - 1 (verl writes at valid_response_length - 1). verl counts the response
    part of attention_mask; for multi-turn rollouts pass that, not a mask with holes on tool tokens, or the index
    lands short of the last token. An empty response (length 0) gives index -1, which, as in verl, is the last
    column; we keep that so that sums and GAE inputs match verl bit for bit.
    """
    if scores.dim() != 1 or response_mask.dim() != 2 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(f"scores must be [B] and response_mask [B, R]; got {tuple(scores.shape)} and "
                         f"{tuple(response_mask.shape)}")
    batch, length = response_mask.shape
    out = torch.zeros(batch, length, dtype=torch.float32, device=response_mask.device)  # [B, R]
    last = (response_mask.sum(-1).long() - 1) % length  # [B]; -1 (empty response) -> R - 1
    out[torch.arange(batch, device=out.device), last] = scores.to(out)
    return out
