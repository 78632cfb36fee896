"""Child process that runs math-verify for `math_equivalence`; started by `rewards._verify`, never imported.

Protocol (one JSON document per line): the parent writes `[gold, answer]` (two LaTeX strings, already normalised);
the child answers `true`, `false`, or `null` (gold not parseable). The first line the child writes is `"ready"` (or
`{"error": ...}`). It runs math-verify on its own main thread with math-verify's signal timeouts off: the parent
bounds every item by killing and restarting this process, which works from any thread of the parent.
"""

import json
import logging
import sys


def main() -> None:
    out = sys.stdout.buffer
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError as error:
        out.write((json.dumps({"error": f"{error}; install it with `pip install math-verify`"}) + "\n").encode())
        out.flush()
        return
    logging.disable(logging.CRITICAL)  # math-verify warns on every call with timeouts off
    gold_config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    answer_config = [
        LatexExtractionConfig(
            normalization_config=NormalizationConfig(units=True),
            boxed_match_priority=0,
            try_extract_without_anchor=False,
        )
    ]
    gold_cache: dict = {}

    def check(gold: str, answer: str):
        if gold not in gold_cache:
            if len(gold_cache) > 10_000:
                gold_cache.clear()
            gold_cache[gold] = parse("\\boxed{" + gold + "}", extraction_config=gold_config, parsing_timeout=None)
        gold_parsed = gold_cache[gold]
        if not gold_parsed:
            return None
        answer_parsed = parse("\\boxed{" + answer + "}", extraction_config=answer_config, parsing_timeout=None)
        return bool(verify(gold_parsed, answer_parsed, timeout_seconds=None))

    check("\\frac{1}{2}", "0.5")  # warm up sympy's lazy imports before the parent starts timing items
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
