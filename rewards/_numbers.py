r"""Plain numbers with an optional known unit or percent sign, read exactly and compared by math-verify's rules.

This is the fast path of `math_equivalence`: most answers (GSM8K, half of MATH) are a number, and reading one here
takes microseconds where sympy takes milliseconds. It must never be looser than the slow path, so it reads only what
it fully understands: a number (`-1,234.50`, `\frac{3}{4}`, `3/4`, `\text{12}`), optionally assigned (`x = 5`),
followed by nothing, a percent sign, or a *known* unit (`\text{ cm}^2`, `\mbox{ inches}`, `5 dollars`). Everything
else (`3x`, `3i`, `2n`, `5 or six`, `5\text{ apples}`) is not a number and goes to the symbolic check, where a letter
stays a variable. Single-letter units (`m`, `g`, `s`, `h`, `L`) count only inside `\text{}`: bare, they are variables.

Comparison follows what math-verify 0.9 computes with sympy 1.14 (grader.py `sympy_numeric_eq`, then its symbolic
fallback): when either side is written with a decimal point, both are rounded to 6 decimals (`1/3` = `0.333333`,
`1/12` = `0.0833333333333333`, `10.0` = `10.0000001`), except against an integer, where only exact equality counts
(`5` = `5.0` but not `5.0000001`: sympy's Integer never equals a Float); two integers compare with their percent signs
dropped (`9\%` = `9`); otherwise exact values compare (`50\%` = `\frac{1}{2}`, `10\%` = `0.1`). Two different units
never match (`5 cm` is not `5 m`; math-verify drops both units). One deliberate difference: two decimals both written
with more than 6 places compare at the shorter one's precision (`.0000672` is not `.0000673`, which math-verify's
6-decimal rounding credits).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

# canonical unit -> its spellings. Plain (not inside \text{}) spellings must be two letters or more.
_UNIT_SPELLINGS = {
    "mm": "mm millimeter millimeters millimetre millimetres",
    "cm": "cm centimeter centimeters centimetre centimetres",
    "m": "m meter meters metre metres",
    "km": "km kilometer kilometers kilometre kilometres",
    "in": "in inch inches",
    "ft": "ft foot feet",
    "yd": "yd yard yards",
    "mi": "mi mile miles",
    "mg": "mg milligram milligrams",
    "g": "g gram grams",
    "kg": "kg kilogram kilograms",
    "lb": "lb lbs pound pounds",
    "oz": "oz ounce ounces",
    "ton": "ton tons tonne tonnes",
    "ml": "ml mL milliliter milliliters millilitre millilitres",
    "l": "l L liter liters litre litres",
    "gal": "gal gallon gallons",
    "qt": "qt quart quarts",
    "pt": "pint pints",
    "cup": "cup cups",
    "s": "s sec secs second seconds",
    "min": "min mins minute minutes",
    "h": "h hr hrs hour hours",
    "day": "day days",
    "week": "week weeks",
    "month": "month months",
    "yr": "yr yrs year years",
    "mph": "mph",
    "km/h": "km/h kmh kph",
    "m/s": "m/s",
    "dollar": "dollar dollars",
    "cent": "cent cents",
    "euro": "euro euros",
    "degree": "degree degrees deg",
    "radian": "radian radians rad",
    "unit": "unit units",
}
_CANONICAL_UNIT = {spelling: unit for unit, spellings in _UNIT_SPELLINGS.items() for spelling in spellings.split()}
_POWER_WORDS = {"square": 2, "sq": 2, "sq.": 2, "cubic": 3, "cu": 3, "cu.": 3}
_SUPERSCRIPTS = {"²": 2, "³": 3}

_TEXT_COMMAND = r"\\(?:text|textbf|textit|textrm|textnormal|mbox|mathrm|mathbf|operatorname)\s*"
_WHOLE_TEXT = re.compile(_TEXT_COMMAND + r"\{([^{}]*)\}")
_POWER = r"(?:\s*\^\s*\{?\s*([23])\s*\}?|\s*([²³]))?"
# No leading \s* in these searched patterns: it would rescan a long run of spaces from every position (quadratic).
_WRAPPED_UNIT = re.compile(_TEXT_COMMAND + r"\{([^{}]*)\}" + _POWER + r"$")
_PLAIN_UNIT = re.compile(r"(?<![A-Za-z\\])((?:(?:square|sq\.?|cubic|cu\.?)\s+)?[A-Za-z][A-Za-z/]+)" + _POWER + r"$")
_PERCENT = re.compile(
    r"\s*(?:\\%|%|" + _TEXT_COMMAND + r"\{\s*(?:\\%|%|percent|percentage|pct)\s*\}|\s+(?:percent|percentage|pct))$"
)
_ASSIGNMENT = re.compile(r"([A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?)\s*=\s*")
_NUMBER = re.compile(r"([-+]?)\s*((?:[1-9]\d{0,2}(?:,\d{3})+|[1-9]\d{0,2}(?: \d{3})+|\d+)(?:\.\d*)?|\.\d+)")
_FRACTION = re.compile(
    r"([-+]?)\s*(?:\\frac\{\s*([-+]?)\s*(\d+)\s*\}\{\s*([-+]?)\s*(\d+)\s*\}|(\d+)\s*/\s*(\d+))"
)
_MAX_CHARS = 200
_DECIMALS = 6  # math-verify's default float_rounding


@dataclass(frozen=True)
class Quantity:
    """A number as written: `value` (the printed number; 12 for `12\\%`), whether it has a decimal point (math-verify
    reads it as a Float) and how many digits follow it, a percent sign, a canonical unit (`cm^2`) and an assigned
    variable (`x = 5`)."""

    value: Fraction
    decimal: bool = False
    percent: bool = False
    places: int = 0  # digits after the decimal point
    unit: str | None = None
    variable: str | None = None

    @property
    def amount(self) -> Fraction:
        """The value a percent sign stands for: 12% -> 3/25."""
        return self.value / 100 if self.percent else self.value


def unit_name(phrase: str, power: str | None = None) -> str | None:
    """`square feet` -> `ft^2`, `cm` + power 2 -> `cm^2`; None when the phrase is not a known unit."""
    words = phrase.split()
    exponent = 1
    if len(words) == 2 and words[0].lower() in _POWER_WORDS:
        exponent, words = _POWER_WORDS[words[0].lower()], words[1:]
    if len(words) != 1:
        return None
    spelling = words[0]
    for candidate in (spelling, spelling.lower()):
        if candidate in _CANONICAL_UNIT:
            unit = _CANONICAL_UNIT[candidate]
            break
    else:
        return None
    if power:
        exponent = _SUPERSCRIPTS.get(power) or int(power)
    return unit if exponent == 1 else f"{unit}^{exponent}"


def split_unit(text: str) -> tuple[str, str | None]:
    r"""`text` without one trailing known unit, and that unit's canonical name: `15\mbox{ cm}^2` -> (`15`, `cm^2`).

    A unit is stripped only when it is known: inside `\text{}`/`\mbox{}`/`\mathrm{}` any spelling (`\text{ m}`),
    bare only a spelling of two letters or more (`5 dollars`, `3 square feet`; never `3x`, `3i`, `2n`).

    Example:
    ```python
    >>> split_unit(r"15\mbox{ cm}^2"), split_unit("5 dollars"), split_unit("3x"), split_unit(r"5\text{ apples}")
    (('15', 'cm^2'), ('5', 'dollar'), ('3x', None), ('5\\text{ apples}', None))
    ```
    """
    wrapped = _WRAPPED_UNIT.search(text)
    if wrapped:
        content, power = wrapped.group(1).strip(), wrapped.group(2) or wrapped.group(3)
        inner_power = re.fullmatch(r"(.*?)\s*(?:\^\s*\{?\s*([23])\s*\}?|([²³]))", content)
        if inner_power and not power:
            content, power = inner_power.group(1), inner_power.group(2) or inner_power.group(3)
        unit = unit_name(content.strip(), power) if content.strip() else None
        if unit is not None and wrapped.start() > 0:
            return text[: wrapped.start()].rstrip(), unit
        return text, None
    plain = _PLAIN_UNIT.search(text)
    if plain and plain.start() > 0 and len(plain.group(1).split()[-1]) >= 2:
        unit = unit_name(plain.group(1), plain.group(2) or plain.group(3))
        if unit is not None:
            return text[: plain.start()].rstrip(), unit
    return text, None


def _signed(sign: str, value: Fraction) -> Fraction:
    return -value if sign == "-" else value


def _read_number(text: str) -> tuple[Fraction, bool, int] | None:
    """(exact value, written with a decimal point, digits after it) of a bare number or fraction, or None."""
    number = _NUMBER.fullmatch(text)
    if number:
        digits = number.group(2).replace(",", "").replace(" ", "")
        places = len(digits.partition(".")[2])
        return _signed(number.group(1), Fraction(digits.rstrip(".") or "0")), "." in digits, places
    fraction = _FRACTION.fullmatch(text)
    if fraction:
        sign, numerator_sign, numerator, denominator_sign, denominator, plain_numerator, plain_denominator = (
            fraction.groups()
        )
        numerator_value = int(numerator if numerator is not None else plain_numerator)
        denominator_value = int(denominator if denominator is not None else plain_denominator)
        if denominator_value == 0:
            return None
        value = Fraction(numerator_value, denominator_value)
        negative = (sign == "-") ^ (numerator_sign == "-") ^ (denominator_sign == "-")
        return (-value if negative else value), False, 0
    return None


def read_quantity(text: str) -> Quantity | None:
    r"""A normalised answer as a `Quantity` when it is a plain number, else None (the symbolic check decides).

    Example:
    ```python
    >>> read_quantity(r"x = -\frac{3}{4}")
    Quantity(value=Fraction(-3, 4), decimal=False, percent=False, places=0, unit=None, variable='x')
    >>> read_quantity(r"12.5\%").amount, read_quantity("3x")
    (Fraction(1, 8), None)
    ```
    """
    text = text.strip()
    if not text or len(text) > _MAX_CHARS:
        return None
    variable = None
    assignment = _ASSIGNMENT.match(text)
    if assignment:
        variable, text = assignment.group(1), text[assignment.end() :]
    whole_text = _WHOLE_TEXT.fullmatch(text)
    if whole_text:  # \text{12} is the number 12
        text = whole_text.group(1).strip()
    percent, unit = False, None
    percent_sign = _PERCENT.search(text)
    if percent_sign and percent_sign.start() > 0:
        percent, text = True, text[: percent_sign.start()].rstrip()
    else:
        text, unit = split_unit(text)
    number = _read_number(text.strip())
    if number is None:
        return None
    value, decimal, places = number
    return Quantity(value, decimal, percent, places, unit, variable)


def _rounded(value: Fraction, places: int) -> int | None:
    """`value` rounded to `places` decimals (scaled by 10**places); None on an exact tie, where sympy's result
    depends on the binary float it read, so the symbolic check decides."""
    scaled = value * 10**places
    floor = scaled.numerator // scaled.denominator
    remainder = scaled - floor
    if remainder == Fraction(1, 2):
        return None
    return floor + 1 if remainder > Fraction(1, 2) else floor


def _is_integer(quantity: Quantity) -> bool:
    """Whether sympy reads it as an Integer: no decimal point, an integral value after the percent sign."""
    return not quantity.decimal and quantity.amount.denominator == 1


def quantities_match(gold: Quantity, answer: Quantity) -> bool | None:
    r"""math-verify's numeric equality of two plain numbers (see the module docstring); None when it depends on how
    sympy rounds an exact tie.

    Example:
    ```python
    >>> [quantities_match(read_quantity(g), read_quantity(a)) for g, a in [("1/3", "0.333333"), ("1/3", "0.33"),
    ...     (r"10\%", "0.1"), ("5", r"5\%"), (r"15\text{ cm}", r"15\text{ m}"), ("x = 2", "y = 2")]]
    [True, False, True, True, False, False]
    ```
    """
    if gold.variable and answer.variable and gold.variable.lower() != answer.variable.lower():
        return False  # x = 2 and y = 2 are different assignments
    if gold.unit and answer.unit and gold.unit != answer.unit:
        return False
    if gold.decimal or answer.decimal:
        if _is_integer(gold) or _is_integer(answer):
            # sympy >= 1.13: Integer(5) != Float(5.0), so the rounded comparison fails and math-verify's symbolic
            # fallback decides: exact equality (5 = 5.0, but 5 != 5.0000001)
            return gold.amount == answer.amount
        # Deliberately stricter than math-verify in one case: two decimals both written beyond 6 places compare at
        # the shorter one's precision (.0000672 is not .0000673; 0.0833333333333333 is 0.08333333).
        places = max(_DECIMALS, min(gold.places, answer.places))
        gold_rounded, answer_rounded = _rounded(gold.amount, places), _rounded(answer.amount, places)
        if gold_rounded is None or answer_rounded is None:
            return None
        return gold_rounded == answer_rounded
    if gold.value.denominator == 1 and answer.value.denominator == 1:
        # math-verify: two integers compare without their percent signs (10 = 10\%) or with them (2 = 200\%)
        return gold.value == answer.value or gold.amount == answer.amount
    return gold.amount == answer.amount


def as_rational(answer: str):
    r"""A normalised answer's exact value when it is a plain number (`-1,234.50`, `\frac{3}{4}`, `x = 5`,
    `72 \text{ cm}`, `12\%` -> 3/25), else None."""
    quantity = read_quantity(answer)
    return None if quantity is None else quantity.amount
