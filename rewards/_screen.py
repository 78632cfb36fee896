r"""Screening LaTeX before it reaches sympy: what is not math, is unsafe, math-verify misreads, or costs minutes.

Golds come from datasets and answers from the model: both are untrusted. Four questions are answered here, with
regular expressions only (linear time, no parsing):

- Is a gold math at all? Prose (`forty two`, `proof omitted`) and placeholders (`N/A`) are not: math-verify would
  read them as products of one-letter symbols (`two forty` = `forty two`), so the sample is skipped (None). A gold
  written as text (`\text{Monday}`, `\text{(C)}`) compares as normalised text instead.
- Is it safe to hand to a parser? Only math-verify's LaTeX extraction runs in the worker (no `parse_expr`, which is an
  `eval`), and on top of that `unsafe` rejects dunder names and attribute access, and `without_calls` turns every call
  of a name outside a whitelist of math functions into the product LaTeX means (`ab(a+b)`), so no Python-shaped text
  reaches sympy even if that ever changed.
- Would math-verify misread it? It adds numbers separated by spaces (`5 \quad 6` = 11) and takes the right-hand side
  of any equation (`7 = 5` equals 5): such answers are not equivalent.
- Would it cost minutes? Towers of powers and huge factorials are rejected before sympy sees them.
"""

from __future__ import annotations

import re
from fractions import Fraction

from ._numbers import split_unit, unit_name

_TEXT_GROUP = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|mbox|mathrm|mathbf)\s*\{([^{}]*)\}")
_NAMED_ARGUMENT = re.compile(r"\\(?:begin|end|operatorname|mathbb|mathcal|mathfrak|mathscr)\s*\{[^{}]*\}")
_COMMAND = re.compile(r"\\[A-Za-z]+")
_SUBSCRIPT = re.compile(r"_\s*(?:\{[^{}]*\}|[A-Za-z0-9])")
_LETTER_RUN = re.compile(r"(?<![A-Za-z\\])[A-Za-z]{2,}")
_PLACEHOLDER = re.compile(r"\s*(?:n\s*/\s*a|n\.a\.?|none|null|nan|-+|\?+|tbd|undefined)\s*", re.IGNORECASE)
_MATH_WORDS = {
    "sin", "cos", "tan", "cot", "sec", "csc", "arcsin", "arccos", "arctan", "sinh", "cosh", "tanh", "log", "ln",
    "exp", "sqrt", "lim", "max", "min", "gcd", "lcm", "det", "mod", "pmod", "deg", "inf", "infty", "infinity", "pi",
    "or", "and", "abs", "floor", "ceil", "arg", "sgn", "sign",
}  # fmt: skip
_NUMBER_WORDS = {
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
    "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety", "hundred", "thousand", "million",
    "billion", "half", "third", "quarter",
}  # fmt: skip
_CLAUSE_WORDS = {"but", "not", "nor", "yes", "no", "too", "is", "are", "was", "the", "for", "all", "if", "so"}
_ALLOWED_TEXT = re.compile(r"\(?[A-Za-z]\)?|,?\s*(?:and|or)\s*,?|,")
_CALL_WHITELIST = _MATH_WORDS | {"binom", "choose", "frac", "sum", "prod", "Re", "Im"}

_DUNDER = re.compile(r"__")
_ATTRIBUTE = re.compile(r"[A-Za-z_)\]}]\s*\.\s*[A-Za-z_]")
_CALL = re.compile(r"(?<![A-Za-z0-9_\\])([A-Za-z_][A-Za-z0-9_]+)\s*\(")

_EQUATION_SPLIT = re.compile(r"(?<![<>!\\])=")
_SEPARATED_DIGITS = re.compile(r"\d\s+\d")
_PATHOLOGICAL = re.compile(
    r"\^\s*\{[^{}]*\^"  # a power inside an exponent: 9^{9^{9}}
    r"|\^\s*[\w.]+\s*\^"  # a chained power: 9^9^9
    r"|\^\s*\{?\s*[-+]?\d{5,}"  # an exponent of 5+ digits
    r"|\d{4,}\s*!|!\s*!"  # big or iterated factorials
)
MAX_SYMBOLIC_CHARS = 1000


def _without_text(latex: str) -> str:
    """`latex` without text groups, named arguments (`\\begin{pmatrix}`) and subscripts (`S_{MBCN}` is a label)."""
    return _SUBSCRIPT.sub(" ", _TEXT_GROUP.sub(" ", _NAMED_ARGUMENT.sub(" ", latex)))


def text_key(latex: str) -> str:
    r"""How a text answer compares: text wrappers, parentheses and periods removed, lower case, single spaces.

    Example:
    ```python
    >>> text_key(r"\text{(C)}"), text_key(r"\textbf{ Monday }"), text_key("(c)")
    ('c', 'monday', 'c')
    ```
    """
    content = _TEXT_GROUP.sub(r" \1 ", latex)
    content = re.sub(r"[().]", " ", content)
    return " ".join(content.lower().split())


def text_gold_key(latex: str) -> str | None:
    r"""The `text_key` of a gold written entirely as text (`\text{Evelyn}`, `\text{(A)}, \text{(C)}`), else None."""
    groups = _TEXT_GROUP.findall(latex)
    if not groups or re.sub(r"\band\b|[\s,;]", "", _TEXT_GROUP.sub("", latex)):
        return None
    content = " ".join(groups)
    if any(character.isdigit() for character in content) or not any(c.isalpha() for c in content):
        return None  # \text{12} is a number, \text{ } nothing
    return text_key(latex)


def is_math_gold(latex: str) -> bool:
    r"""False for a gold that is prose or a placeholder (`forty two`, `proof omitted`, `N/A`): not math, no answer
    can be checked against it. Known units (`5 inches`), math function names and one- to three-letter products of
    variables (`2xy`, `abc`) are math; words of four letters or more, and number words, are prose.

    Example:
    ```python
    >>> [is_math_gold(g) for g in ["forty two", "N/A", "proof omitted", "2xy", r"\cot x", r"864 \mbox{ inches}^2"]]
    [False, False, False, True, True, True]
    ```
    """
    if not latex.strip() or _PLACEHOLDER.fullmatch(latex):
        return False
    core, _ = split_unit(latex)
    plain = _COMMAND.sub(" ", _without_text(core))
    for word in _LETTER_RUN.findall(plain):
        lower = word.lower()
        if lower in _NUMBER_WORDS or (len(word) >= 4 and lower not in _MATH_WORDS):
            return False
    return True


def without_calls(latex: str) -> str:
    r"""`latex` with every call-shaped `name(` outside the math whitelist written as the product it means in LaTeX:
    `ab(a+b)` -> `ab\cdot(a+b)` (latex2sympy reads both as a*b*(a+b)), `eval(1)` -> `eval\cdot(1)`. After this no
    Python call of a name outside the whitelist is left in the text, whatever a parser later does with it.

    Example:
    ```python
    >>> without_calls("ab(a+b)"), without_calls(r"\sin(x) + f(x)"), without_calls("eval ('x')")
    ('ab\\cdot(a+b)', '\\sin(x) + f(x)', "eval\\cdot('x')")
    ```
    """
    def as_product(call: re.Match) -> str:
        return call.group(0) if call.group(1) in _CALL_WHITELIST else call.group(1) + "\\cdot("

    return _CALL.sub(as_product, latex)


def unsafe(latex: str) -> bool:
    r"""True when the text has Python shapes no answer needs: a dunder, attribute access (`a.b`), or a call to a name
    outside the math whitelist (`eval(`; `without_calls` rewrites those first). Such text is never handed to a
    parser.

    Example:
    ```python
    >>> [unsafe(t) for t in ["__import__('os')", "os.system", "eval(1)", r"\sin(x)", "f(x)", "3.5x", r"\log(2)"]]
    [True, True, True, False, False, False, False]
    ```
    """
    if _DUNDER.search(latex) or _ATTRIBUTE.search(latex):
        return True
    return any(name not in _CALL_WHITELIST for name in _CALL.findall(latex))


def is_equation(latex: str) -> bool:
    return bool(_EQUATION_SPLIT.search(latex))


def misread(answer: str, gold: str) -> bool:
    r"""True for an answer math-verify would credit for a reason that is not equivalence with `gold`:

    - digits separated only by spaces (`5 6`, `5\quad 6`): math-verify adds them (`= 11`);
    - an equation compared with a non-equation gold when its left side has no variable (`7 = 5`, `2+2 = 5`):
      math-verify keeps only the right side;
    - a chain stating two different numbers (`x = 7 = 11`): math-verify keeps the last one;
    - a clause in words (`0 \text{, but maybe } 7`, `0 but 7`, `5 \text{ apples}`): math-verify multiplies words in
      as symbols, and a zero absorbs them. Known units, one-letter choice labels (`\text{(C)}`), `and`/`or` (which
      math-verify reads as a list) and words the gold itself contains are allowed.

    Example:
    ```python
    >>> [misread(a, "5") for a in ["5 6", "7 = 5", "2+2 = 5", "x = 5", "x+y = 5", "x = 7 = 11", "x = 3+4 = 7"]]
    [True, True, True, False, False, True, False]
    >>> [misread(a, "0") for a in [r"0 \text{, but maybe } 7", "0 but 7", r"0\text{ cm}", r"0 \text{ or } 1", "0 xy"]]
    [True, True, False, False, False]
    ```
    """
    if _SEPARATED_DIGITS.search(answer) or _clause_in_words(answer, gold):
        return True
    sides = _EQUATION_SPLIT.split(answer)
    if len(sides) < 2:
        return False
    if not is_equation(gold) and not re.search(r"[A-Za-z]", _COMMAND.sub("", sides[0])):
        return True
    numbers = {Fraction(side.strip()) for side in sides if re.fullmatch(r"\s*-?\d+(?:\.\d+)?\s*", side)}
    return len(numbers) > 1


def _clause_in_words(answer: str, gold: str) -> bool:
    gold_texts = {content.strip().lower() for content in _TEXT_GROUP.findall(gold)}
    for content in _TEXT_GROUP.findall(answer):
        content = content.strip()
        if not re.search(r"[A-Za-z]", content) or _ALLOWED_TEXT.fullmatch(content) or content.lower() in gold_texts:
            continue
        if unit_name(content) is None:
            return True
    gold_words = {word.lower() for word in _LETTER_RUN.findall(gold)}
    for word in _LETTER_RUN.findall(_COMMAND.sub(" ", _without_text(answer))):
        lower = word.lower()
        if lower in gold_words or unit_name(word) is not None:
            continue
        if lower in _CLAUSE_WORDS or lower in _NUMBER_WORDS or (len(word) >= 4 and lower not in _MATH_WORDS):
            return True
    return False


def pathological(latex: str) -> bool:
    """True for inputs sympy would evaluate for minutes: towers of powers, exponents of 5+ digits, huge factorials,
    more than MAX_SYMBOLIC_CHARS characters."""
    return len(latex) > MAX_SYMBOLIC_CHARS or bool(_PATHOLOGICAL.search(latex))
