"""Known-answer tests for every reward scorer, routing, extraction and the format reward.

Test ids name the behaviour: `released-...` is a behaviour of the LLaVA-OV-1.5-RL / ROLL code that ovkit keeps,
`change-...` a deliberate change documented in docs/rewards.md.
"""

from __future__ import annotations

import json

import pytest

from ovkit.errors import OvkitError
from ovkit.rewards import ALIASES, SANDBOXED, SCORERS, extract_answer, format_reward, resolve_scorer, score, score_batch

SVG_CIRCLE = (
    '<svg xmlns="http://www.w3.org/2000/svg" width="100" height="100">'
    '<rect width="100" height="100" fill="white"/><circle cx="50" cy="50" r="30" fill="red"/></svg>'
)
SVG_SQUARE = (
    '<svg xmlns="http://www.w3.org/2000/svg" width="100" height="100">'
    '<rect x="10" y="60" width="30" height="30" fill="blue"/></svg>'
)
CODE_SQUARE = json.dumps({"entry": "solution", "tests": [{"input": 3, "output": 9}, {"input": -4, "output": 16}]})
DET_GOLD = json.dumps([{"label": "cat", "box": [10, 10, 50, 50]}, {"label": "dog", "box": [60, 60, 90, 90]}])


def A(text: str) -> str:
    return f"<answer>{text}</answer>"


# (id, answer_type, completion, answer, reward_kwargs, expected reward)
CASES = [
    # multiple choice
    ("mc-released-letter", "multiple_choice", A("B"), "B", None, 1.0),
    ("mc-released-strip-parens-dot-lowercase", "multiple-choice", A(" (b). "), "B", None, 1.0),
    ("mc-released-first-char-of-option-text", "multiple_choice", A("B. a red cat"), "B", None, 1.0),
    ("mc-released-wrong-letter", "multiple_choice", A("C"), "B", None, 0.0),
    ("mc-released-sentence-first-char-is-not-the-answer", "multiple_choice", A("The answer is B"), "B", None, 0.0),
    ("mc-change-a-word-is-not-its-first-letter", "multiple_choice", A("ares"), "A", None, 0.0),
    ("mc-change-a-word-is-not-its-first-letter-untagged", "multiple_choice", "areen triangle", "A", None, 0.0),
    ("mc-lower-case-letter-alone", "multiple_choice", A("a"), "A", None, 1.0),
    ("mc-letter-with-parentheses-and-text", "multiple_choice", A("(C) blue star"), "C", None, 1.0),
    ("mc-change-gold-normalised-like-prediction", "multiple_choice", A("B"), "(B)", None, 1.0),
    ("mc-untagged-short-output", "multiple_choice", "B", "B", None, 1.0),
    ("mc-empty-answer-scores-0", "multiple_choice", A(""), "B", None, 0.0),
    # number
    ("number-released-equal", "number", A("3"), "3", None, 1.0),
    ("number-released-last-number", "number", A("I see 2 red and 3 blue, so 5"), "5", None, 1.0),
    ("number-change-3.0-equals-3", "number", A("3.0"), "3", None, 1.0),
    ("number-change-minus-sign-kept", "number", A("-2"), "2", None, 0.0),
    ("number-change-negative-gold", "number", A("-2"), "-2", None, 1.0),
    ("number-change-thousands-separator", "number", A("1,234"), "1234", None, 1.0),
    ("number-change-number-word", "number", A("three"), "3", None, 1.0),
    ("number-change-compound-number-word", "number", A("twenty-one"), "21", None, 1.0),
    ("number-change-range-is-not-negative", "number", A("3-4"), "4", None, 1.0),
    ("number-rel-tol", "number", A("10.4"), "10", {"rel_tol": 0.05}, 1.0),
    ("number-rel-tol-exceeded", "number", A("10.6"), "10", {"rel_tol": 0.05}, 0.0),
    ("number-no-number", "number", A("many"), "3", None, 0.0),
    ("number-untagged-short-output", "number", "4", "4", None, 1.0),
    # ocr
    ("ocr-released-exact-case-and-spaces", "ocrtext", A("Hello   World"), "hello world", None, 1.0),
    ("ocr-released-one-edit", "ocr", A("helo world"), "hello world", None, 1 - 1 / 11),
    ("ocr-released-below-half-is-0", "ocr", A("abc"), "hello world", None, 0.0),
    ("ocr-released-best-alternative", "ocr", A("STOP"), '["go", "stop"]', None, 1.0),
    ("ocr-threshold-kwarg", "ocr", A("helo world"), "hello world", {"threshold": 0.95}, 0.0),
    # boolean / string / critic
    ("boolean-released-yes", "boolean", A("Yes"), "yes", None, 1.0),
    ("boolean-released-true-is-yes", "boolean", A("True."), "yes", None, 1.0),
    ("boolean-released-no-vs-yes", "bool", A("no"), "yes", None, 0.0),
    ("boolean-unknown-word", "boolean", A("maybe"), "no", None, 0.0),
    ("string-released-case-insensitive", "any", A("A Red Circle"), "a red circle", None, 1.0),
    ("string-change-trailing-full-stop-and-spaces", "string", A("a red  circle."), "a red circle", None, 1.0),
    ("string-released-different-text", "string", A("red circle"), "a red circle", None, 0.0),
    ("string-alternatives", "string", A("two"), '["2", "two"]', None, 1.0),
    ("critic-released-exact", "critic", A("Correct"), "Correct", None, 1.0),
    ("critic-released-case-sensitive", "critic", A("correct"), "Correct", None, 0.0),
    # bbox
    ("bbox-released-exact", "bbox", A("[10, 20, 30, 40]"), "[10, 20, 30, 40]", None, 1.0),
    ("bbox-released-iou-third", "bbox", A("[0, 0, 10, 10]"), "[5, 0, 15, 10]", None, 1 / 3),
    ("bbox-released-first-box-in-text", "bbox", A("box (0, 0, 10, 10) then [5, 0, 15, 10]"), "[0,0,10,10]", None, 1.0),
    ("bbox-qwen-dict-answer", "bbox", A('{"bbox_2d": [0, 0, 10, 10], "label": "cat"}'), "[0,0,10,10]", None, 1.0),
    ("bbox-change-inverted-box-is-0", "bbox", A("[10, 10, 0, 0]"), "[0, 0, 10, 10]", None, 0.0),
    ("bbox-no-box", "bbox", A("top left"), "[0, 0, 10, 10]", None, 0.0),
    (
        "bbox-pixel-prediction-norm1000-gold",
        "bbox",
        A("[20, 10, 100, 50]"),
        "[100, 100, 500, 500]",
        {"coords": "norm1000", "pred_coords": "pixel", "image_size": [200, 100]},
        1.0,
    ),
    (
        "bbox-norm1000-prediction-norm1-gold",
        "bbox",
        A("[100,100,500,500]"),
        "[0.1,0.1,0.5,0.5]",
        {"coords": "norm1", "pred_coords": "norm1000"},
        1.0,
    ),
    # detection (ROLL rules; default weights: label-first IoU, completeness weight 0.3)
    ("detection-roll-perfect", "detection", A(DET_GOLD), DET_GOLD, None, 1.0),
    (
        "detection-roll-one-missing-size-penalty",
        "detection",
        A('[{"label": "cat", "box": [10, 10, 50, 50]}]'),
        DET_GOLD,
        None,
        (0.7 * 0.5 + 0.3 * 0.75) * 0.6,
    ),
    (
        "detection-roll-wrong-label-label-first",
        "detection",
        A('[{"label": "dog", "box": [10, 10, 50, 50]}]'),
        '[{"label": "cat", "box": [10, 10, 50, 50]}]',
        None,
        0.0,
    ),
    (
        "detection-roll-wrong-label-iou-first-keeps-completeness",
        "detection",
        A('[{"label": "dog", "box": [10, 10, 50, 50]}]'),
        '[{"label": "cat", "box": [10, 10, 50, 50]}]',
        {"weights": {"iou_max_iou_first": 1.0, "iou_max_label_first": 0.0}},
        0.3,
    ),
    (
        "detection-roll-fixed-threshold-0.5",
        "detection",
        A('[{"label": "cat", "box": [10, 10, 50, 50]}]'),
        '[{"label": "cat", "box": [10, 10, 50, 54]}]',
        {"iou_threshold": 0.5},
        0.7 * (1600 / 1760) + 0.3,
    ),
    (
        "detection-roll-fixed-threshold-0.95",
        "detection",
        A('[{"label": "cat", "box": [10, 10, 50, 50]}]'),
        '[{"label": "cat", "box": [10, 10, 50, 54]}]',
        {"iou_threshold": 0.95},
        0.0,
    ),
    (
        "detection-roll-average-threshold",
        "detection",
        A('[{"label": "cat", "box": [10, 10, 50, 50]}]'),
        '[{"label": "cat", "box": [10, 10, 50, 54]}]',
        None,
        9 / 11 * (0.7 * (1600 / 1760) + 0.3),
    ),
    (
        "detection-roll-dynamic-early-0.85",
        "detection",
        A('[{"label": "cat", "box": [10, 10, 50, 50]}]'),
        '[{"label": "cat", "box": [10, 10, 50, 54]}]',
        {"iou_threshold": "dynamic", "step": 5, "total_steps": 100},
        0.7 * (1600 / 1760) + 0.3,
    ),
    (
        "detection-roll-dynamic-late-0.99",
        "detection",
        A('[{"label": "cat", "box": [10, 10, 50, 50]}]'),
        '[{"label": "cat", "box": [10, 10, 50, 54]}]',
        {"iou_threshold": "dynamic", "step": 50, "total_steps": 100},
        0.0,
    ),
    (
        "detection-roll-map50",
        "detection",
        A(DET_GOLD),
        DET_GOLD,
        {"weights": {"map50": 1.0, "iou_max_label_first": 0}},
        1.0,
    ),
    (
        "detection-roll-single-quotes-bbox_2d-and-cut-off-list",
        "detection",
        A(
            "[{'bbox_2d': [10, 10, 50, 50], 'label': 'cat'}, {'bbox_2d': [60, 60, 90, 90], 'label': 'dog'}, "
            "{'bbox_2d': [1"
        ),
        DET_GOLD,
        None,
        1.0,
    ),
    ("detection-unparsable", "detection", A("a cat and a dog"), DET_GOLD, None, 0.0),
    # html
    (
        "html-released-exact-up-to-whitespace",
        "html-code",
        A("<div>\n  <p>hi</p>\n</div>"),
        "<div><p>hi</p></div>",
        None,
        1.0,
    ),
    ("html-released-jaccard-weights", "html", A("<div><p>hi</p></div>"), "<div><p>hello</p></div>", None, 0.7),
    ("html-fenced-code", "html", A("```html\n<div><p>hi</p></div>\n```"), "<div><p>hi</p></div>", None, 1.0),
    # format as a scorer
    ("format-scorer-answer-mode", "format", A("3"), "", None, 1.0),
    ("format-scorer-missing-container", "format", "3", "", None, 0.0),
]

SANDBOXED_CASES = [
    # math (math-verify, gold first, in a killable worker)
    ("math-released-latex-vs-decimal", "math-expressions", A("\\frac{1}{2}"), "0.5", None, 1.0),
    ("math-released-expression-vs-latex", "math", A("1/2"), "$\\frac{1}{2}$", None, 1.0),
    ("math-released-boxed", "math", "so the answer is \\boxed{42}", "42", None, 1.0),
    ("math-released-wrong", "math", A("4"), "3", None, 0.0),
    ("math-released-fallback-2-decimals", "math", A("3.141"), "3.14", None, 1.0),
    ("math-released-letter-answer", "math", A("B"), "B", None, 1.0),
    ("math-equation-rhs", "math", A("x = 2"), "2", None, 1.0),
    # svg
    ("svg-released-exact", "svg-code", A(SVG_CIRCLE), SVG_CIRCLE, None, 1.0),
    ("svg-released-fenced", "svg", A("```svg\n" + SVG_CIRCLE + "\n```"), SVG_CIRCLE, None, 1.0),
    # code
    ("code-released-all-pass", "general-code", A("def solution(x):\n    return x * x"), CODE_SQUARE, None, 1.0),
    ("code-released-partial-is-0", "code", A("def solution(x):\n    return x * 3"), CODE_SQUARE, None, 0.0),
    ("code-syntax-error", "code", A("def solution(x) return"), CODE_SQUARE, None, 0.0),
    ("code-missing-entry", "code", A("def f(x):\n    return x * x"), CODE_SQUARE, None, 0.0),
    (
        "code-args-form",
        "code",
        "```python\ndef add(a, b):\n    return a + b\n```",
        json.dumps({"entry": "add", "tests": [{"args": [2, 5], "output": 7}, {"args": [[1], [2]], "output": [1, 2]}]}),
        None,
        1.0,
    ),
]


@pytest.mark.parametrize(
    "answer_type,completion,answer,kwargs,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_known_answers(answer_type, completion, answer, kwargs, expected):
    result = score(completion, answer, answer_type, reward_kwargs=kwargs)
    assert result.reward == pytest.approx(expected, abs=1e-6)
    assert 0.0 <= result.reward <= 1.0
    assert result.parts["timeout"] is False


def test_sandboxed_known_answers():
    # one batch, so the worker processes start once
    items = [dict(completion=c[2], answer=c[3], answer_type=c[1], reward_kwargs=c[4]) for c in SANDBOXED_CASES]
    results = score_batch(items, workers=2, timeout=20.0)
    got = {c[0]: r.reward for c, r in zip(SANDBOXED_CASES, results)}
    assert got == pytest.approx({c[0]: c[5] for c in SANDBOXED_CASES}, abs=1e-6)


def test_code_pass_rate_part():
    result = score(A("def solution(x):\n    return 9"), CODE_SQUARE, "code")
    assert result.reward == 0.0 and result.parts["pass_rate"] == 0.5 and result.parts["passed"] == 1


def test_svg_partial_credit_orders_sensibly():
    near = SVG_CIRCLE.replace('r="30"', 'r="27"')
    results = score_batch(
        [dict(completion=A(p), answer=SVG_CIRCLE, answer_type="svg") for p in (near, SVG_SQUARE)], timeout=20.0
    )
    assert 0.8 < results[0].reward < 1.0 and results[0].parts["rendered"]
    assert results[1].reward < results[0].reward


def test_svg_change_blank_image_guard():
    """A blank canvas scores SSIM ~1 against a mostly white target; the guard gives it no image score."""
    sparse_gold = (
        '<svg xmlns="http://www.w3.org/2000/svg" width="100" height="100"><circle cx="50" cy="50" r="8"/></svg>'
    )
    blank = '<svg xmlns="http://www.w3.org/2000/svg" width="100" height="100"></svg>'
    result = score(A(blank), sparse_gold, "svg", timeout=20.0)
    assert result.parts["blank"] is True and result.parts["ssim"] == 0.0
    assert result.reward < 0.3


def test_svg_unrenderable_and_oversized():
    entity = '<?xml version="1.0"?><!DOCTYPE svg [<!ENTITY a "x">]><svg xmlns="http://www.w3.org/2000/svg">&a;</svg>'
    huge = SVG_SQUARE.replace("</svg>", "<!--" + "x" * 60_000 + "--></svg>")
    results = score_batch(
        [dict(completion=A(s), answer=SVG_CIRCLE, answer_type="svg") for s in (entity, huge)], timeout=20.0
    )
    for r in results:
        assert r.parts["rendered"] is False and r.parts["ssim"] == 0.0 and r.reward < 0.5


# ---- extraction ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,strict,expected",
    [
        ("<answer>1</answer> then <answer> 2 </answer>", False, "2"),
        ("<think>maybe <answer>1</answer></think><answer>2</answer>", True, "2"),
        ("no tags at all", True, None),
        ("the result is \\boxed{\\frac{1}{2}} indeed", False, "\\frac{1}{2}"),
        ("\\boxed{1} and \\boxed{2}", False, "2"),
        ("\\boxed{unbalanced and \\boxed{3}", False, "3"),
        ("<answer>\\boxed{7}</answer>", True, "7"),
        ("<think>long reasoning</think> 42 ", False, "42"),
        ("<think>never closed", False, None),
        ("<answer>cut off by the token lim", False, "cut off by the token lim"),
        ("", False, None),
    ],
)
def test_extract_answer(text, strict, expected):
    assert extract_answer(text, strict=strict) == expected


def test_strict_extraction_kwarg():
    assert score("B", "B", "multiple_choice", reward_kwargs={"strict": True}).reward == 0.0
    assert score(A("B"), "B", "multiple_choice", reward_kwargs='{"strict": true}').reward == 1.0


# ---- format ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion,mode,expected",
    [
        (A("3"), "answer", 1.0),
        ("3", "answer", 0.0),
        (A("3") + A("4"), "answer", 0.0),
        ("\\boxed{3}", "answer", 1.0),
        ("<answer>3", "answer", 0.0),
        ("<think>count the shapes one by one: there are three</think>" + A("3"), "think", 1.0),
        ("<think>three shapes</think>" + A("3"), "default", 1.0),
        (A("3"), "think", 0.0),
        ("<think>a</think>" + A("a very long answer that is most of the text"), "think", 0.0),
        ("<think>a</think><think>b</think>" + A("3"), "think", 0.0),
        ("<think>reasoning about it for a while</think>\\boxed{3}", "think", 1.0),
    ],
)
def test_format_reward(completion, mode, expected):
    assert format_reward(completion, mode).reward == expected


def test_format_weight_mixes_accuracy_and_format():
    untagged = score("B", "B", "multiple_choice", reward_kwargs={"format_weight": 0.25})
    assert untagged.reward == pytest.approx(0.75) and untagged.parts["format"] == 0.0
    thinking = score("<think>it is the second one</think>" + A("B"), "B", "multiple_choice", prompt_type="think")
    assert thinking.reward == 1.0 and thinking.parts["format"] == 1.0


# ---- routing and API ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "alias",
    [
        "multiple-choice",
        "math-expressions",
        "html-code",
        "svg-code",
        "general-code",
        "bbox",
        "number",
        "critic",
        "boolean",
        "ocrtext",
        "any",
    ],
)
def test_released_answer_types_are_accepted(alias):
    assert resolve_scorer(alias, None) in SCORERS
    assert resolve_scorer(alias.upper(), None) == resolve_scorer(alias, None)


def test_aliases_point_at_scorers():
    assert set(ALIASES.values()) <= set(SCORERS)
    assert SANDBOXED <= set(SCORERS)


def test_unknown_answer_type():
    with pytest.raises(OvkitError, match="unknown scorer 'colour'"):
        resolve_scorer("colour", None)


def test_source_tag_routing_roll_tag_included():
    source_map = {"synth": "string", "synth/count": "number", "refcoco": "bbox"}
    assert resolve_scorer(None, "synth/count/v2", source_map) == "number"  # the longest tag wins
    assert resolve_scorer("", "synth/caption", source_map) == "string"
    assert resolve_scorer("ocrtext", "synth/count", source_map) == "ocr"  # answer_type comes first
    assert score("3 shapes", "3", source="synth/count", source_map=source_map).reward == 1.0
    with pytest.raises(OvkitError, match="matches no tag"):
        resolve_scorer(None, "coyo", source_map)


@pytest.mark.parametrize(
    "answer_type,answer,kwargs,message",
    [
        ("number", "3", '{"rel_tol": ', "not JSON"),
        ("number", "3", "[1, 2]", "expected a JSON object"),
        ("number", "3", {"iou_threshold": 0.5}, "takes no iou_threshold"),
        ("number", "many", None, "expected a number"),
        ("bbox", "[1, 2, 3]", None, "expected a box"),
        ("bbox", "[0, 0, 1, 1]", {"coords": "pixel", "pred_coords": "norm1"}, "image_size"),
        ("bbox", "[0, 0, 1, 1]", {"coords": "percent"}, "must be one of"),
        ("detection", "[]", None, "non-empty list"),
        ("detection", DET_GOLD, {"weights": {"iou": 1}}, "detection weight"),
        ("detection", DET_GOLD, {"iou_threshold": 0.42}, "iou_threshold"),
        ("multiple_choice", "B", {"format_weight": 2}, "format_weight"),
    ],
)
def test_bad_rows_raise_ovkit_error(answer_type, answer, kwargs, message):
    with pytest.raises(OvkitError, match=message):
        score(A("3"), answer, answer_type, reward_kwargs=kwargs)


def test_batch_errors_name_the_row():
    items = [
        {"completion": "3", "answer": "3", "answer_type": "number"},
        {"id": "row-7", "completion": "3", "answer": "x", "answer_type": "number"},
    ]
    with pytest.raises(OvkitError, match="row 'row-7' \\(index 1\\)"):
        score_batch(items)
    with pytest.raises(OvkitError, match="prompt_type"):
        score("3", "3", "number", prompt_type="chatty")


def test_cheap_scorers_never_start_a_worker(monkeypatch):
    import ovkit.rewards as rewards

    def no_pool():
        raise AssertionError("a cheap scorer asked for the worker pool")

    monkeypatch.setattr(rewards, "shared_pool", no_pool)
    items = [dict(completion=c[2], answer=c[3], answer_type=c[1], reward_kwargs=c[4]) for c in CASES]
    results = score_batch(items)
    assert [r.reward for r in results] == pytest.approx([c[5] for c in CASES], abs=1e-6)


def test_custom_scorer_plugs_in(monkeypatch):
    from ovkit.rewards import Reward

    def length_scorer(completion, answer, *, limit=10):
        return Reward(float(len(completion) <= limit), {"length": len(completion)})

    monkeypatch.setitem(SCORERS, "short", length_scorer)
    assert score("abc", "", "short", reward_kwargs={"limit": 2}).reward == 0.0
    assert score("abc", "", "short").parts["length"] == 3


@pytest.mark.parametrize(
    "item,column",
    [
        ({"answer": "3", "answer_type": "number"}, None),
        ({"answer": None, "answer_type": "format"}, None),
        ({"answer": None, "answer_type": "number"}, "answer"),
        ({"answer": " ", "answer_type": "string"}, "answer"),
        ({"answer": "3", "answer_type": None}, "answer_type"),
        ({"answer": "3", "answer_type": "telepathy"}, "answer_type"),
        ({"answer": "many", "answer_type": "number"}, "answer"),
        ({"answer": "maybe", "answer_type": "boolean"}, "answer"),
        ({"answer": "()", "answer_type": "multiple_choice"}, "answer"),
        ({"answer": "[1, 2]", "answer_type": "bbox"}, "answer"),
        ({"answer": '{"entry": "f"}', "answer_type": "code"}, "answer"),
        ({"answer": "3", "answer_type": "number", "reward_kwargs": '{"tolerance": 1}'}, "reward_kwargs"),
        ({"answer": "3", "answer_type": "number", "reward_kwargs": "[1]"}, "reward_kwargs"),
    ],
)
def test_check_gold_reads_the_gold_answer_as_its_scorer_does(item, column):
    from ovkit.rewards import check_gold

    if column is None:
        check_gold(item)
    else:
        with pytest.raises(OvkitError, match=f"^column '{column}': "):
            check_gold(item)
