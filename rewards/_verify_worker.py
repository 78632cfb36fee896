"""Child process that runs math-verify for `math_equivalence`; started by `rewards._verify`, never imported.

Usage: `python _verify_worker.py <parent pid>`. Protocol, one JSON document per line: the parent writes
`[gold, answer]` (LaTeX already normalised and screened by the parent); the child answers `true`, `false`, or `null`
(math-verify cannot parse the gold). Its first line is `"ready"` once sympy is warm, or `{"error": ...}`.

Only math-verify's LaTeX extraction runs (never `ExprExtractionConfig`, whose `parse_expr` is an `eval`), with
`units=False`: the parent already removed the units it knows, and anything else left in the answer must stay part of
the answer (math-verify would drop any trailing `\\text{...}` and words such as `m`, `d`, `t`). Timeouts are the
parent's job (it kills this process), so math-verify's `signal.alarm` timeouts are off.

The child dies with its parent: the kernel kills it when the parent's spawning thread ends (PR_SET_PDEATHSIG on
Linux), a watchdog thread exits when the parent pid changes (any OS), and the read loop ends at end of input.
"""

import json
import logging
import os
import sys
import threading
import time


def die_with_parent(parent_pid: int) -> None:
    try:  # Linux: SIGKILL from the kernel even while sympy holds the GIL in a long C call
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


# Warm-up pairs: one of each kind of comparison, so the first real item does not pay for sympy's lazy imports and
# caches (a cold worker took 1.5 s on items a warm one checks in 50 ms).
WARM_UP = [
    ("\\frac{1}{2}", "0.5"),
    ("2\\sqrt{3}", "\\sqrt{12}"),
    ("x^2+2x+1", "(x+1)^2"),
    ("\\frac{x^2-1}{x-1}", "x+1"),
    ("\\sin^2 x + \\cos^2 x", "1"),
    ("(1,2)", "(1, 2)"),
    ("[1,2)", "[1,2)"),
    ("\\{1,2\\}", "\\{2,1\\}"),
    ("x \\in [-2,7]", "[-2,7]"),
    ("y = 2x + 3", "y = 3 + 2x"),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
    ("\\frac{\\pi}{2}", "\\frac{\\pi}{2}"),
    ("-1", "e^{i\\pi}"),
    ("10\\%", "0.1"),
    ("\\log_2 8", "3"),
]


def main() -> None:
    out = sys.stdout.buffer
    parent_pid = int(sys.argv[1]) if len(sys.argv) > 1 else os.getppid()
    die_with_parent(parent_pid)
    try:
        import sympy
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError as error:
        out.write((json.dumps({"error": f"{error}; install it with `pip install math-verify`"}) + "\n").encode())
        out.flush()
        return
    logging.disable(logging.CRITICAL)  # math-verify warns on every call with timeouts off
    config = [
        LatexExtractionConfig(
            normalization_config=NormalizationConfig(basic_latex=True, units=False, malformed_operators=False),
            boxed_match_priority=0,
            try_extract_without_anchor=False,
        )
    ]
    imaginary = sympy.Symbol("i")
    gold_cache: dict = {}

    def parsed(latex: str) -> list:
        return parse("\\boxed{" + latex + "}", extraction_config=config, parsing_timeout=None)

    def with_imaginary_unit(gold: list, answer: list) -> bool:
        """latex2sympy reads `i` as a variable, so `e^{i\\pi}` is not -1 for math-verify. When the gold is a number
        (or a complex number in `i`) and the answer's only free symbol is `i`, compare with `i` as the imaginary
        unit."""
        for gold_expr in gold:
            for answer_expr in answer:
                if not (isinstance(gold_expr, sympy.Basic) and isinstance(answer_expr, sympy.Basic)):
                    continue
                gold_names = {symbol.name for symbol in gold_expr.free_symbols}
                answer_names = {symbol.name for symbol in answer_expr.free_symbols}
                if not answer_names <= {"i"} or not gold_names <= {"i"} or not (gold_names | answer_names):
                    continue
                if not (isinstance(gold_expr, sympy.Expr) and isinstance(answer_expr, sympy.Expr)):
                    continue
                substitute = {symbol: sympy.I for symbol in gold_expr.free_symbols | answer_expr.free_symbols}
                difference = sympy.simplify(gold_expr.xreplace(substitute) - answer_expr.xreplace(substitute))
                if difference == 0:
                    return True
        return False

    def check(gold: str, answer: str):
        if gold not in gold_cache:
            if len(gold_cache) > 10_000:
                gold_cache.clear()
            gold_cache[gold] = parsed(gold)
        gold_parsed = gold_cache[gold]
        if not gold_parsed:
            return None
        answer_parsed = parsed(answer)
        if verify(gold_parsed, answer_parsed, timeout_seconds=None):
            return True
        return with_imaginary_unit(gold_parsed, answer_parsed) if imaginary.name in answer else False

    for gold, answer in WARM_UP:
        check(gold, answer)
    gold_cache.clear()
    out.write(b'"ready"\n')
    out.flush()
    for line in sys.stdin.buffer:
        try:
            gold, answer = json.loads(line)
            result = check(gold, answer)
        except Exception:
            result = False
        out.write((json.dumps(result) + "\n").encode())
        out.flush()


if __name__ == "__main__":
    main()
