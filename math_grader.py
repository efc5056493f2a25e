"""When two math answers are equal: verl's MATH normal form, Minerva's (DAPO's), and our stand-in for mathruler's
grader (geo3k).

rewards.py extracts the answer from a response and scores it; this module only compares answer strings:
    math_is_equiv(answer, ground_truth)        verl v0.5.0 verl/utils/reward_score/math.py `is_equiv`
    minerva_normalize(answer)                  verl v0.5.0 verl/utils/reward_score/math_dapo.py
                                               `normalize_final_answer` (Minerva's, via lm-evaluation-harness)
    geo3k_grade_answer(answer, ground_truth)   mathruler.grader `grade_answer`, which verl v0.5.0
                                               verl/utils/reward_score/geo3k.py calls (mathruler is not a dependency)
    geo3k_extract_boxed(solution_str)          mathruler.grader `extract_boxed_content`
Leaves out what mathruler does beyond the rules listed where the geo3k section opens. Imports nothing of ours.
"""
import ast
import math
import re

try:  # exact symbolic comparison for geo3k answers; plain float comparison without it
    import sympy
except ImportError:  # pragma: no cover - sympy ships with torch
    sympy = None


# ---------------------------------------------------------------------------------------------------------------
# MATH (verl/utils/reward_score/math.py: the Hendrycks MATH string normalisation)

class _NotNormalisable(Exception):
    """The normalisation hit a case verl's code crashes on; verl then compares the raw strings."""


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


# ---------------------------------------------------------------------------------------------------------------
# DAPO's math (verl/utils/reward_score/math_dapo.py): Minerva's normal form, compared as strings. Each rule runs on
# the whole string in this order, so "a " goes wherever it occurs (also inside words: "Panama " -> "Panam"),
# exactly as verl's does: the same answers match.

MINERVA_SUBSTITUTIONS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                         (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
MINERVA_REMOVED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
                   "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters",
                   "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}",
                   "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ",
                   "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots")
# (pattern, replacement) in order: the first $...$ span alone, then \text{x} \textbf{x} \overline{x} -> x,
# \boxed{...} -> its content (greedy), \fracab -> \frac{a}{b}, \sqrta -> \sqrt{a}
MINERVA_REWRITES = ((r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$"), (r"(\\text\{)(.*?)(\})", "\\2"),
                    (r"(\\textbf\{)(.*?)(\})", "\\2"), (r"(\\overline\{)(.*?)(\})", "\\2"),
                    (r"(\\boxed\{)(.*)(\})", "\\2"), (r"(frac)([^{])(.)", "frac{\\2}{\\3}"),
                    (r"(sqrt)([^{])", "sqrt{\\2}"))


def minerva_normalize(answer):
    """Minerva's normal form of a final answer: the part after the last "=", the substitutions and removals above,
    LaTeX wrappers unwrapped, "$" dropped, thousands commas dropped from an integer, outer spaces stripped."""
    answer = answer.split("=")[-1]
    for old, new in MINERVA_SUBSTITUTIONS:
        answer = answer.replace(old, new)
    for removed in MINERVA_REMOVED:
        answer = answer.replace(removed, "")
    for pattern, replacement in MINERVA_REWRITES:
        answer = re.sub(pattern, replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


# ---------------------------------------------------------------------------------------------------------------
# geo3k: verl/utils/reward_score/geo3k.py grades with mathruler.grader.grade_answer, which is not installed here.
# Our stand-in follows mathruler's decisions where they are cheap to reproduce:
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
