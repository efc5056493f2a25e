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
"""
import ast
import importlib.util
import math
import os
import re

import torch

try:  # exact symbolic comparison for geo3k answers; plain float comparison without it
    import sympy
except ImportError:  # pragma: no cover - sympy ships with torch
    sympy = None


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
# MATH (verl/utils/reward_score/math.py: the Hendrycks MATH string normalisation)

class _NotNormalisable(Exception):
    """The normalisation hit a case verl's code crashes on; verl then compares the raw strings."""


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


def _strip_right_units(text):
    """Drop a trailing "\\text{ unit}" (note the space after the brace)."""
    pieces = text.split("\\text{ ")
    if len(pieces) > 2:
        raise _NotNormalisable("more than one '\\text{ '")
    return pieces[0]


def _fix_sqrt(text):
    """\\sqrt3 -> \\sqrt{3}: wrap the single character after a brace-less \\sqrt."""
    head, *pieces = text.split("\\sqrt")
    for piece in pieces:
        if not piece:
            raise _NotNormalisable("\\sqrt at the end")
        head += "\\sqrt" + (piece if piece[0] == "{" else "{" + piece[0] + "}" + piece[1:])
    return head


def _fix_fracs(text):
    """\\frac12 -> \\frac{1}{2}, \\frac1{7} -> \\frac{1}{7}; a lone character after \\frac leaves the text as is."""
    head, *pieces = text.split("\\frac")
    for piece in pieces:
        if not piece:
            raise _NotNormalisable("\\frac at the end")
        if piece[0] == "{":
            head += "\\frac" + piece
        elif len(piece) < 2:
            return text
        elif piece[1] == "{":
            head += "\\frac{" + piece[0] + "}" + piece[1:]
        else:
            head += "\\frac{" + piece[0] + "}{" + piece[1] + "}" + piece[2:]
    return head


def _fix_a_slash_b(text):
    """"3/4" -> "\\frac{3}{4}" when both sides are plain integers written canonically."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        numerator, denominator = int(parts[0]), int(parts[1])
    except ValueError:
        return text
    if text != f"{numerator}/{denominator}":
        return text
    return "\\frac{" + str(numerator) + "}{" + str(denominator) + "}"


def math_normalize(text):
    """verl's MATH normal form of an answer string; raises _NotNormalisable where verl's code would crash."""
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                     ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        text = text.replace(old, new)
    text = _strip_right_units(text)
    text = text.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 5" -> " 5"
        text = sides[1]
    text = _fix_sqrt(text).replace(" ", "")
    text = _fix_fracs(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _fix_a_slash_b(text)


def math_is_equiv(answer, ground_truth):
    """Equal normal forms; if either cannot be normalised, equal raw strings (verl's fallback)."""
    if answer is None or ground_truth is None:
        return answer is None and ground_truth is None
    try:
        return math_normalize(answer) == math_normalize(ground_truth)
    except _NotNormalisable:
        return answer == ground_truth


def math_compute_score(solution_str, ground_truth):
    """1.0 if the last boxed answer is equivalent to ground_truth, else 0.0."""
    answer = math_last_boxed_answer(solution_str)
    return 1.0 if answer is not None and math_is_equiv(answer, ground_truth) else 0.0


# ---------------------------------------------------------------------------------------------------------------
# geo3k (verl/utils/reward_score/geo3k.py). verl grades with mathruler.grade_answer, which is not installed here.
# Our grader follows mathruler's decisions where they are cheap to reproduce:
#   1. equal normal forms (the MATH rules above, plus: \text{..} unwrapped, $ % ° \circ and mathruler's unit words
#      (cm, feet, degrees, ...) dropped, lower case, trailing "." dropped) -> correct;
#   2. if exactly one of the two is an integer, or both are integer fractions \frac{p}{q} -> incorrect (mathruler
#      refuses to simplify these, so an unreduced fraction does not match a reduced one);
#   3. otherwise both are turned into arithmetic (\frac, \sqrt, \pi, \cdot, \times, ^, implicit products, single-
#      letter variables) and compared with sympy.simplify(a - b) == 0, or with math.isclose when sympy is missing.
# Differences from mathruler: no pylatexenc LaTeX-to-text pass (other LaTeX commands just fail step 3), no
# tuple/interval splitting, no "million"/mixed-number rewriting, and a missing \boxed{} gives
# accuracy 0 (mathruler grades the string "None", which only matters for a ground truth of "None").

_UNIT_WORDS = re.compile(r"(?:degree|cm|centimeter|meter|mile|second|minute|hour|day|week|month|year|foot|feet|inch"
                         r"|yard)(?:es)?s? *(?:\^[0-9]+)?")  # mathruler's list, removed wherever it appears
_GEO3K_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
_INTEGER_FRACTION = re.compile(r"-?\\frac\{-?\d+\}\{\d+\}")
_MAX_EXPONENT = 100  # keeps sympy and float powers from running away on answers like 9^99999
_MAX_ARITHMETIC_CHARS = 200  # and sympy.simplify from chewing on a long boxed paragraph
_ARITHMETIC_TOKEN = r"\d+\.?\d*|\.\d+|sqrt|pi|[a-z]|[-+*/^()]"


def geo3k_extract_boxed(solution_str):
    """The stripped content of the last \\boxed{...} (brace-balanced), or None (mathruler's extract_boxed_content)."""
    start = solution_str.rfind("\\boxed{")
    if start < 0:
        return None
    content = solution_str[start + len("\\boxed{"):]
    depth = 0
    for end, char in enumerate(content):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == -1:
            return content[:end].strip()
    return None


def _geo3k_normalize(text):
    """MATH normal form plus the unit/formatting clean-up of step 1 above."""
    text = re.sub(r"\\(?:text|mbox|mathrm)\{([^{}]*)\}", r"\1", text.strip())
    for mark in ("^{\\circ}", "^\\circ", "°", "\\%", "%", "\\$", "$"):
        text = text.replace(mark, "")
    text = _UNIT_WORDS.sub("", text)
    try:
        text = math_normalize(text)
    except _NotNormalisable:
        pass
    return text.rstrip(".").lower()


def _is_integer_string(text):
    try:
        value = float(text.replace(",", ""))
    except ValueError:
        return False
    return math.isfinite(value) and value == round(value)


def _latex_to_arithmetic(text):
    """"2\\sqrt{3}" -> "2*sqrt(3)"; None if text uses LaTeX we do not translate or is too big to simplify safely."""
    for old, new in (("\\cdot", "*"), ("\\times", "*"), ("\\pi", "pi")):
        text = text.replace(old, new)
    rewrites = ((r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)"), (r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))"),
                (r"(?<![}a-z])\{([^{}]*)\}", r"(\1)"))  # a plain group such as ^{2}, never a \frac argument
    previous = None
    while previous != text:  # innermost groups first, until nothing changes
        previous = text
        for pattern, replacement in rewrites:
            text = re.sub(pattern, replacement, text)
    if "\\" in text or len(text) > _MAX_ARITHMETIC_CHARS:
        return None
    tokens = re.findall(_ARITHMETIC_TOKEN + r"|\S", text)  # \S catches anything else
    variables = {t for t in tokens if len(t) == 1 and t.isalpha()}
    if len(variables) > 2 or any(re.fullmatch(_ARITHMETIC_TOKEN, t) is None for t in tokens):
        return None
    pieces = []
    for token in tokens:  # make implicit products explicit: 2sqrt(3) -> 2*sqrt(3), 3x -> 3*x, )( -> )*(
        ends_operand = pieces and (pieces[-1][-1].isalnum() or pieces[-1] == ")") and pieces[-1] != "sqrt"
        if ends_operand and (token[0].isalnum() or token[0] in ".("):
            pieces.append("*")
        pieces.append("**" if token == "^" else token)
    return "".join(pieces)


def _check_power(base, exponent, use_sympy):
    """Refuse powers that could take sympy or the float code a long time: a symbolic or large exponent, or a
    numeric result above ~1e300 (so nested powers cannot grow without bound)."""
    if use_sympy and not exponent.is_number or abs(float(exponent)) > _MAX_EXPONENT:
        raise ValueError("exponent must be a number of magnitude at most 100")
    if (not use_sympy or base.is_number) and math.log10(abs(float(base)) + 1) * abs(float(exponent)) > 300:
        raise ValueError("power too large")


def _evaluate(expression, use_sympy):
    """Evaluate arithmetic from _latex_to_arithmetic with sympy (exact, symbols allowed) or floats (numbers only)."""
    def visit(node):
        if isinstance(node, ast.Expression):
            return visit(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return sympy.Rational(repr(node.value)) if use_sympy else float(node.value)
        if isinstance(node, ast.Name):
            if node.id == "pi":
                return sympy.pi if use_sympy else math.pi
            if use_sympy:
                return sympy.Symbol(node.id)
            raise ValueError("variables need sympy")
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            value = visit(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "sqrt" and len(node.args) == 1:
            value = visit(node.args[0])
            return sympy.sqrt(value) if use_sympy else math.sqrt(value)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow)):
            left, right = visit(node.left), visit(node.right)
            if isinstance(node.op, ast.Pow):
                _check_power(left, right, use_sympy)
            operations = {ast.Add: lambda: left + right, ast.Sub: lambda: left - right, ast.Mult: lambda: left * right,
                          ast.Div: lambda: left / right, ast.Pow: lambda: left ** right}
            return operations[type(node.op)]()
        raise ValueError(f"unsupported expression part {type(node).__name__}")
    return visit(ast.parse(expression, mode="eval"))


def _arithmetic_equal(answer, ground_truth, use_sympy=sympy is not None):
    """Both LaTeX strings denote the same value (False when either cannot be translated or evaluated)."""
    expressions = [_latex_to_arithmetic(answer), _latex_to_arithmetic(ground_truth)]
    if None in expressions:
        return False
    try:
        left, right = (_evaluate(e, use_sympy) for e in expressions)
        if use_sympy:
            return sympy.simplify(left - right) == 0
        return math.isclose(left, right, rel_tol=1e-9, abs_tol=1e-12)
    except (ValueError, TypeError, ZeroDivisionError, OverflowError, SyntaxError, RecursionError):
        return False


def geo3k_grade_answer(answer, ground_truth):
    """Our stand-in for mathruler.grade_answer; see the comment block above for the rules."""
    if answer is None:
        return False
    given, truth = _geo3k_normalize(answer), _geo3k_normalize(str(ground_truth))
    if given == truth:
        return True
    if _is_integer_string(given) or _is_integer_string(truth):
        both_integers = _is_integer_string(given) and _is_integer_string(truth)
        return both_integers and float(given.replace(",", "")) == float(truth.replace(",", ""))
    if _INTEGER_FRACTION.fullmatch(given) and _INTEGER_FRACTION.fullmatch(truth):
        return False
    return _arithmetic_equal(given, truth)


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
    "minirl/box": minirl_add_compute_score,      # the tool demo (demo_tools.py): the same "#### N" rule
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
