"""Rule-based rewards with verl's semantics (verl/utils/reward_score + NaiveRewardManager).

What it does: turns a decoded response and a ground truth into a scalar score, per data_source, exactly as verl's
`default_compute_score` would for the sources minirl supports, and places that score on the last valid response
token. Usage:

    fn = load_reward_fn(cfg.custom_reward_function.path, cfg.custom_reward_function.name)  # None -> built-ins
    scores, extras = score_responses(fn, responses, data_sources, ground_truths, extra_infos)
    token_scores = token_level_scores(torch.tensor(scores), response_mask)               # [B, R]

Built-in data sources (see SCORERS): openai/gsm8k, the three MATH names, hiyouga/geometry3k and the demo task
minirl/add. Any scorer takes (data_source, solution_str, ground_truth, extra_info=None), the signature verl uses for
`custom_reward_function`, and returns a number or a dict holding "score".
The answer comparisons (verl's MATH normal form, our stand-in for mathruler's grader) live in math_grader.py.
"""
import importlib.util
import math
import os
import re

import torch

from math_grader import geo3k_extract_boxed, geo3k_grade_answer, math_is_equiv


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


def geo3k_compute_score(solution_str, ground_truth, format_score=0.1):
    """(1 - format_score)·acc + format_score·fmt, i.e. 0.9·acc + 0.1·fmt."""
    accuracy = 1.0 if geo3k_grade_answer(geo3k_extract_boxed(solution_str), ground_truth) else 0.0
    formatted = 1.0 if geo3k_format_ok(solution_str) else 0.0
    return (1.0 - format_score) * accuracy + format_score * formatted


# ---------------------------------------------------------------------------------------------------------------
# the demo task: add two numbers, answer as "#### N"

def minirl_add_compute_score(solution_str, ground_truth):
    """1.0 for a correct strict "#### N", 0.1 for a wrong one, 0.0 without one (gsm8k strict extraction)."""
    return gsm8k_compute_score(solution_str, str(ground_truth), method="strict", format_score=0.1, score=1.0)


# ---------------------------------------------------------------------------------------------------------------
# dispatch, loading, batch scoring

SCORERS = {
    "openai/gsm8k": gsm8k_compute_score,
    "lighteval/MATH": math_compute_score,
    "DigitalLearningGmbH/MATH-lighteval": math_compute_score,
    "HuggingFaceH4/MATH-500": math_compute_score,
    "hiyouga/geometry3k": geo3k_compute_score,
    "minirl/add": minirl_add_compute_score,
}


def default_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's default_compute_score for the sources in SCORERS; returns a float."""
    scorer = SCORERS.get(data_source)
    if scorer is None:
        raise NotImplementedError(
            f"no built-in reward for data_source={data_source!r}; known: {sorted(SCORERS)}. Write "
            f"compute_score(data_source, solution_str, ground_truth, extra_info=None) in a .py file and set "
            f"custom_reward_function.path (and custom_reward_function.name if the function has another name)")
    return float(scorer(solution_str, ground_truth))


def load_reward_fn(path=None, name="compute_score"):
    """default_compute_score when path is None, else function `name` from the python file at `path`."""
    if path is None:
        return default_compute_score
    if not os.path.isfile(path):
        raise FileNotFoundError(f"custom_reward_function.path={path!r} is not a file; point it at a .py file "
                                f"defining {name}(data_source, solution_str, ground_truth, extra_info=None)")
    spec = importlib.util.spec_from_file_location("minirl_custom_reward", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        raise ImportError(f"importing custom_reward_function.path={path!r} failed: {error!r}") from error
    fn = getattr(module, name, None)
    if not callable(fn):
        available = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(f"custom_reward_function.name={name!r} is not a function in {path!r}; "
                             f"functions there: {available}")
    return fn


def _excerpt(text, width=120):
    """The start and end of a long response (the answer usually sits at the end)."""
    if len(text) <= width:
        return text
    return text[:width // 2] + " ... " + text[-width // 2:]


def _score_and_extra(result):
    """(float score, extra dict) from a scorer result: a number/bool or a dict holding "score"."""
    extra = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"a dict result must contain 'score'; got keys {sorted(result)}")
        extra = {k: v for k, v in result.items() if k != "score"}
        result = result["score"]
    try:
        score = float(result) if hasattr(result, "__float__") else None  # a str has no __float__: "1" is refused
    except (TypeError, ValueError, RuntimeError):  # e.g. a tensor with several elements
        score = None
    if score is None:
        raise ValueError(f"score must be a number, a bool or a dict with 'score'; got {type(result).__name__} "
                         f"{result!r:.80}")
    if not math.isfinite(score):
        raise ValueError(f"score is {score}")
    return score, extra


def score_responses(fn, responses, data_sources, ground_truths, extra_infos=None):
    """Score every row with fn; returns (scores: list[float], extras: list[dict]).

    fn is called with keywords, as verl's NaiveRewardManager does. extras[i] holds the keys of a dict result other
    than "score" ({} for a plain number). Any failure names the row instead of producing a silent wrong score.
    """
    if extra_infos is None:
        extra_infos = [None] * len(responses)
    lengths = {len(responses), len(data_sources), len(ground_truths), len(extra_infos)}
    if len(lengths) != 1:
        raise ValueError(f"responses/data_sources/ground_truths/extra_infos have different lengths "
                         f"{len(responses)}/{len(data_sources)}/{len(ground_truths)}/{len(extra_infos)}")
    scores, extras = [], []
    for row, (response, source, truth, info) in enumerate(zip(responses, data_sources, ground_truths, extra_infos)):
        where = f"row {row} (data_source={source!r}, response={_excerpt(response)!r})"
        try:
            result = fn(data_source=source, solution_str=response, ground_truth=truth, extra_info=info)
        except Exception as error:
            raise RuntimeError(f"reward function {getattr(fn, '__name__', fn)} raised on {where}: {error!r}") \
                from error
        try:
            score, extra = _score_and_extra(result)
        except ValueError as error:
            raise RuntimeError(f"reward function {getattr(fn, '__name__', fn)} returned a bad score on {where}: "
                               f"{error}") from error
        scores.append(score)
        extras.append(extra)
    return scores, extras


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
