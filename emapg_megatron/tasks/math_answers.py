"""A math response's final answer, as text: extraction, normalisation and the fast path.

1. **Extract** the final answer: the content of the last *complete* ``\\boxed{...}`` (or
   ``\\fbox{...}``; braces are matched, so nesting is fine; an unclosed, truncated ``\\boxed{``
   is skipped in favour of the previous complete one). When several boxed answers appear, **the
   last one counts**. Without a boxed answer there is none, unless ``last_number`` (opt-in,
   ``--math-last-number-fallback``) takes the last number in the text (``-12``, ``3.5``,
   ``1,000``, ``3/4``): a policy can learn to end any text with likely numbers, so a reward
   should ask for the box (as DeepScaleR's and verl's math rewards do). With ``think_end_tag`` (e.g. ``"</think>"``) set, only the
   text after the last such tag is searched, and a response without the tag has no answer.
2. **Fast path** (:func:`fast_check`): normalised strings equal -> correct; both sides plain
   rationals (``0.5``, ``1/2``, ``\\frac{1}{2}``) that are equal -> correct; both plain integers
   that differ -> wrong; anything else is for math-verify (:mod:`.math_verifier`).

Pure text: no process, no math-verify.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional, Sequence, Union

__all__ = ["extract_answer", "last_boxed", "last_number", "is_well_formatted", "gold_answers",
           "fast_check", "GroundTruth"]

GroundTruth = Union[str, Sequence[str]]

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\b")
_NUMBER_RE = re.compile(
    r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?(?![\w])|(?<![\w.])-?\.\d+"
)


def _brace_matches(text: str) -> dict[int, int]:
    """``{open index: close index}`` for every balanced ``{...}`` (``\\{``, ``\\}`` are literals).

    One linear pass, so a degenerate response with thousands of unclosed ``\\boxed{`` costs
    O(len) rather than O(len^2).
    """
    matches: dict[int, int] = {}
    stack: list[int] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            matches[stack.pop()] = i
        i += 1
    return matches


def last_boxed(text: str) -> Optional[str]:
    """Content of the last complete ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed 5``)."""
    found = list(_BOXED_RE.finditer(text))
    if not found:
        return None
    matches: Optional[dict[int, int]] = None
    for m in reversed(found):
        i = m.end()
        while i < len(text) and text[i] in " \t":
            i += 1
        if i < len(text) and text[i] == "{":
            if matches is None:
                matches = _brace_matches(text)
            end = matches.get(i)
            if end is None:
                continue  # truncated: fall back to an earlier complete one
            return text[i + 1 : end].strip()
        if m.end() < len(text) and text[m.end()] in " \t":  # "\\boxed 5"
            tok = re.match(r"[^\s$]+", text[i:])
            if tok:
                return tok.group(0).rstrip(".")
    return None


def last_number(text: str) -> Optional[str]:
    """The last number in the text (``-12``, ``3.5``, ``1,000``, ``3/4``), or None."""
    found = _NUMBER_RE.findall(text)
    if not found:
        return None
    return re.sub(r"\s+", "", found[-1])


def _region(response: str, think_end_tag: Optional[str]) -> Optional[str]:
    """The text an answer is searched in: after the last ``think_end_tag`` (None without it)."""
    if think_end_tag:
        pos = response.rfind(think_end_tag)
        if pos < 0:
            return None
        return response[pos + len(think_end_tag) :]
    return response


def extract_answer(response: str, think_end_tag: Optional[str] = None, last_number_fallback: bool = False
                   ) -> Optional[str]:
    """The final answer of a response (see the module docstring), or None."""
    region = _region(response, think_end_tag)
    if region is None:
        return None
    boxed = last_boxed(region)
    if boxed is not None:
        return boxed if boxed else None
    return last_number(region) if last_number_fallback else None


def is_well_formatted(response: str, think_end_tag: Optional[str] = None) -> bool:
    """A complete, non-empty ``\\boxed{}`` in the searched region (what the format bonus pays)."""
    region = _region(response, think_end_tag)
    if region is None:
        return False
    boxed = last_boxed(region)
    return bool(boxed)


def _gold_answer(gt: str) -> str:
    gt = str(gt).strip()
    if "\\boxed" in gt or "\\fbox" in gt:
        b = last_boxed(gt)
        if b:
            return b
    return gt


def gold_answers(ground_truth: GroundTruth) -> list[str]:
    """The non-empty reference answers of a ground truth (one or a list), unboxed."""
    if isinstance(ground_truth, (list, tuple)):
        items = [str(g) for g in ground_truth if g is not None and str(g).strip()]
    elif ground_truth is None:
        items = []
    else:
        items = [str(ground_truth)] if str(ground_truth).strip() else []
    return [_gold_answer(g) for g in items]


# --- the fast path: easy equivalences decided without math-verify --------------------------------
_SPACING_RE = re.compile(r"\\(?:left|right|displaystyle|,|;|:|!| |quad|qquad)(?![a-zA-Z])")


def _normalize(s: str) -> str:
    s = s.strip()
    if len(s) >= 2 and s[0] == "$" and s[-1] == "$":
        s = s.strip("$")
    s = _SPACING_RE.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    return s


_INT_RE = re.compile(r"^[+-]?\d+$")
_DEC_RE = re.compile(r"^[+-]?(?:\d+\.\d*|\.\d+)$")
_SLASH_RE = re.compile(r"^([+-]?\d+)/(\d+)$")
_FRAC_RE = re.compile(r"^([+-]?)\\frac\{([+-]?\d+)\}\{(\d+)\}$")
_FRAC_SHORT_RE = re.compile(r"^([+-]?)\\frac(\d)(\d)$")


def _rational(s: str) -> Optional[tuple[Fraction, bool]]:
    """(value, is_integer_literal) for a plain rational literal, else None."""
    try:
        if _INT_RE.match(s):
            return Fraction(int(s)), True
        if _DEC_RE.match(s):
            return Fraction(s), False
        m = _SLASH_RE.match(s)
        if m and int(m.group(2)) != 0:
            return Fraction(int(m.group(1)), int(m.group(2))), False
        m = _FRAC_RE.match(s) or _FRAC_SHORT_RE.match(s)
        if m and int(m.group(3)) != 0:
            v = Fraction(int(m.group(2)), int(m.group(3)))
            return (-v if m.group(1) == "-" else v), False
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return None


def fast_check(golds: Sequence[str], pred: str) -> Optional[bool]:
    """Decide easy cases without math-verify; None means "ask the verifier"."""
    pn = _normalize(pred)
    gns = [_normalize(g) for g in golds]
    if any(pn == g for g in gns):
        return True
    if len(pn) > 64:
        return None
    pr = _rational(pn)
    if pr is None:
        return None
    grs = [_rational(g) if len(g) <= 64 else None for g in gns]
    if any(gr is not None and gr[0] == pr[0] for gr in grs):
        return True
    if pr[1] and all(gr is not None and gr[1] for gr in grs):
        return False
    return None
