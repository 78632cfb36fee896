r"""Exact polynomial identity for answers such as `x^5 - x^4 + x^3 - x^2 + x - 1` or `(a+5)(b+2)`, without sympy.

math-verify parses LaTeX with an ANTLR grammar in pure Python: about 7 ms per term, so a correct 129-term polynomial
takes 2 s to parse and runs out of any sane per-item time limit. Two polynomials with rational coefficients are
equal as expressions exactly when their expanded forms are equal, which is what sympy's symbolic check concludes for
them too; expanding them here takes a millisecond.

`read_polynomial` accepts integers, `\frac{..}{..}` with a constant denominator, square roots of integers
(`3\sqrt{12}` = `6\sqrt{3}`), single-letter variables (with a subscript: `F_{10}`; upper case reads as lower case,
as math-verify reads symbols), Greek-letter variables (`\pi`, `\theta`), `+ - \cdot \times`, implicit products,
parentheses and non-negative integer powers. It declines
(returns None) on anything else, so the symbolic check decides: decimals, `e` (a constant), `i` next to other
variables (alone it is the imaginary unit: `i^2` = -1), a letter before `(` (latex2sympy may read `f(x)` as a
function), a mixed number (`4\frac{2}{3}`), an unbraced multi-digit exponent (`x^12`), a power of a sum above
`MAX_GROUP_POWER`, or more than `MAX_TERMS` terms.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_TERMS = 4000
MAX_GROUP_POWER = 24
MAX_CHARS = 20_000
MAX_COEFFICIENT_BITS = 100_000

Monomial = tuple  # sorted ((variable, exponent), ...)
Polynomial = dict  # Monomial -> Fraction, no zero coefficients

_GREEK = {
    "alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta", "vartheta", "kappa",
    "lambda", "mu", "nu", "xi", "pi", "rho", "sigma", "tau", "upsilon", "phi", "varphi", "chi", "psi", "omega",
}  # fmt: skip
_TOKEN = re.compile(
    r"\s*(?:(?P<number>\d+(?:\.\d*)?)"
    r"|(?P<variable>[A-Za-z](?:_(?:\{\s*[A-Za-z0-9]+\s*\}|[A-Za-z0-9]))?)"
    r"|\\(?P<command>[A-Za-z]+)"
    r"|(?P<symbol>[-+*^(){}]))"
)


class _Decline(Exception):
    """The text is not a polynomial this reader understands."""


def _tokens(text: str) -> list[tuple[str, str]]:
    tokens, position = [], 0
    text = text.rstrip()
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None:
            raise _Decline
        kind = match.lastgroup
        value = match.group(kind)
        if kind == "number" and "." in value:
            raise _Decline  # decimals follow math-verify's rounding rules, not exact identity
        if kind == "variable":
            letter, _, subscript = value.partition("_")
            if letter in "eE" and not subscript:
                raise _Decline  # Euler's number is not a variable
            value = letter.lower() + ("_" + subscript.strip("{} ") if subscript else "")
        if kind == "command":
            if value in ("cdot", "times"):
                kind, value = "symbol", "*"
            elif value in ("frac", "sqrt"):
                kind = value
            elif value in _GREEK:
                kind = "variable"
            else:
                raise _Decline
        tokens.append((kind, value))
        position = match.end()
    return tokens


def _multiply(left: Polynomial, right: Polynomial) -> Polynomial:
    if len(left) * len(right) > MAX_TERMS * 4:
        raise _Decline
    product: dict = {}
    for monomial_a, coefficient_a in left.items():
        for monomial_b, coefficient_b in right.items():
            powers = dict(monomial_a)
            for variable, exponent in monomial_b:
                powers[variable] = powers.get(variable, 0) + exponent
            key = tuple(sorted(powers.items()))
            product[key] = product.get(key, 0) + coefficient_a * coefficient_b
    result = {key: value for key, value in product.items() if value != 0}
    if len(result) > MAX_TERMS:
        raise _Decline
    return result


def _add(left: Polynomial, right: Polynomial, sign: int = 1) -> Polynomial:
    total = dict(left)
    for monomial, coefficient in right.items():
        total[monomial] = total.get(monomial, 0) + sign * coefficient
    return {key: value for key, value in total.items() if value != 0}


class _Parser:
    """Recursive descent: sum := term (('+'|'-') term)*; term := factor (['*'] factor)*; factor := atom ['^' exp]."""

    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.tokens, self.index = tokens, 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.index] if self.index < len(self.tokens) else None

    def take(self, kind: str, value: str | None = None) -> str:
        token = self.peek()
        if token is None or token[0] != kind or (value is not None and token[1] != value):
            raise _Decline
        self.index += 1
        return token[1]

    def sum(self) -> Polynomial:
        total: Polynomial = {}
        sign = 1
        if self.peek() in (("symbol", "+"), ("symbol", "-")):
            sign = -1 if self.take("symbol") == "-" else 1
        total = _add(total, self.term(), sign)
        while self.peek() in (("symbol", "+"), ("symbol", "-")):
            sign = -1 if self.take("symbol") == "-" else 1
            total = _add(total, self.term(), sign)
        return total

    def term(self) -> Polynomial:
        product = self.factor()
        while True:
            token = self.peek()
            if token == ("symbol", "*"):
                self.take("symbol")
                product = _multiply(product, self.factor())
            elif token is not None and (token[0] in ("number", "variable", "frac", "sqrt") or token[1] in ("(", "{")):
                previous = self.tokens[self.index - 1]
                if token[0] == "number" and previous[0] != "symbol":
                    raise _Decline  # `x2`, `(x)3`, `2 3`: not a reading everyone agrees on
                if token[0] == "frac" and previous[0] == "number":
                    raise _Decline  # `4\frac{2}{3}` is a mixed number (4 + 2/3) for latex2sympy
                product = _multiply(product, self.factor())
            else:
                return product

    def factor(self) -> Polynomial:
        base = self.atom()
        if self.peek() != ("symbol", "^"):
            return base
        self.take("symbol")
        exponent = self.exponent()
        if len(base) == 1:  # a monomial c*x^a*y^b: scale its exponents, raise its coefficient
            ((monomial, coefficient),) = base.items()
            size = abs(coefficient.numerator).bit_length() + coefficient.denominator.bit_length()
            if size * exponent > MAX_COEFFICIENT_BITS:
                raise _Decline  # 2^{999999}: left to the symbolic check and its time limit
            powers = tuple((variable, power * exponent) for variable, power in monomial if power * exponent)
            return {powers: coefficient**exponent}  # x^0 is 1: no (x, 0) entry, which would differ from ()
        if exponent > MAX_GROUP_POWER:
            raise _Decline  # (x+1)^{9999}
        result: Polynomial = {(): Fraction(1)}
        for _ in range(exponent):
            result = _multiply(result, base)
        return result

    def exponent(self) -> int:
        token = self.peek()
        if token == ("symbol", "{"):
            self.take("symbol")
            value = self.take("number")
            self.take("symbol", "}")
        else:
            value = self.take("number")
            if len(value) > 1:
                raise _Decline  # `x^12`: LaTeX reads x^1 2, latex2sympy x^12
        if len(value) > 7:
            raise _Decline
        return int(value)

    def atom(self) -> Polynomial:
        kind, value = self.peek() or ("end", "")
        if kind == "number":
            self.take("number")
            return {(): Fraction(int(value))} if int(value) else {}
        if kind == "variable":
            self.take("variable")
            if self.peek() == ("symbol", "("):
                raise _Decline  # latex2sympy reads `p(x)` as a function
            return {((value, 1),): Fraction(1)}
        if kind == "sqrt":
            self.take("sqrt")
            self.take("symbol", "{")
            radicand = int(self.take("number"))
            self.take("symbol", "}")
            return _square_root(radicand)
        if kind == "frac":
            self.take("frac")
            numerator = self.braced()
            denominator = self.braced()
            if len(denominator) != 1 or () not in denominator:
                raise _Decline  # only constant denominators keep it a polynomial
            return {key: coefficient / denominator[()] for key, coefficient in numerator.items()}
        if (kind, value) in (("symbol", "("), ("symbol", "{")):
            closing = ")" if value == "(" else "}"
            self.take("symbol")
            inner = self.sum()
            self.take("symbol", closing)
            return inner
        raise _Decline

    def braced(self) -> Polynomial:
        self.take("symbol", "{")
        inner = self.sum()
        self.take("symbol", "}")
        return inner


def read_polynomial(text: str) -> Polynomial | None:
    r"""The expanded polynomial of a normalised LaTeX answer, or None when it is not one this reader understands.

    Example:
    ```python
    >>> read_polynomial("(a+5)(b+2)") == read_polynomial("ab + 2a + 5b + 10")
    True
    >>> read_polynomial("x^5 - x^4") == read_polynomial("x^4(x + 1)"), read_polynomial("2.5x"), read_polynomial("f(x)")
    (False, None, None)
    ```
    """
    if not text or len(text) > MAX_CHARS:
        return None
    try:
        parser = _Parser(_tokens(text))
        if not parser.tokens:
            return None
        polynomial = parser.sum()
        if parser.peek() is not None:
            return None
        return _with_imaginary_unit(_with_square_roots(polynomial))
    except (_Decline, RecursionError, ZeroDivisionError):
        return None


def _square_free(number: int) -> tuple[int, int]:
    """(k, m) with number = k^2 * m and m square-free."""
    if number > 10**8:
        raise _Decline  # factoring it is not a fast path
    outside, inside, factor = 1, number, 2
    while factor * factor <= inside:
        while inside % (factor * factor) == 0:
            inside //= factor * factor
            outside *= factor
        factor += 1
    return outside, inside


def _square_root(radicand: int) -> Polynomial:
    r"""`\sqrt{n}` as k * sqrt(m) with m square-free: a coefficient and one radical "variable"."""
    outside, inside = _square_free(radicand)
    if radicand == 0:
        return {}
    return {(): Fraction(outside)} if inside == 1 else {((f"\u221a{inside}", 1),): Fraction(outside)}


def _with_square_roots(polynomial: Polynomial) -> Polynomial:
    """Products and powers of square roots reduced to one square-free radical per term (sqrt2^2 = 2,
    sqrt6 * sqrt10 = 2 sqrt15): square roots of distinct square-free integers are linearly independent over the
    rationals, so two answers are equal exactly when their reduced forms are."""
    reduced: Polynomial = {}
    for monomial, coefficient in polynomial.items():
        radicand, rest = 1, []
        for variable, exponent in monomial:
            if variable.startswith("\u221a"):
                base = int(variable[1:])
                coefficient *= base ** (exponent // 2)
                radicand *= base ** (exponent % 2)
            else:
                rest.append((variable, exponent))
        outside, inside = _square_free(radicand)
        key = tuple(sorted(rest + ([(f"\u221a{inside}", 1)] if inside > 1 else [])))
        reduced[key] = reduced.get(key, 0) + coefficient * outside
    return {key: value for key, value in reduced.items() if value != 0}


def _with_imaginary_unit(polynomial: Polynomial) -> Polynomial:
    """`i` is the imaginary unit (i^2 = -1) when it is the only letter, as the symbolic check reads it then;
    next to other variables it could be an index, so the symbolic check decides."""
    variables = {variable for monomial in polynomial for variable, _ in monomial}
    if "i" not in variables:
        return polynomial
    if len(variables) > 1:
        raise _Decline
    reduced: Polynomial = {}
    for monomial, coefficient in polynomial.items():
        power = dict(monomial).get("i", 0) % 4
        key = (("i", 1),) if power % 2 else ()
        reduced[key] = reduced.get(key, 0) + (coefficient if power < 2 else -coefficient)
    return {key: value for key, value in reduced.items() if value != 0}
