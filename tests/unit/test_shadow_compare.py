"""compare_outputs: identical, close, flipped, mismatched, nan, int and string outputs, and a
property test that no numeric arrays make it raise."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import fuzzing  # the hypothesis profile: bounded examples in `make test`, many more in `make fuzz`
from servewell.engine.shadow_compare import OutputAgreement, compare_outputs

LOGITS = np.array([[0.1, 0.7, 0.2], [0.5, 0.3, 0.2], [0.0, 0.1, 0.9], [0.3, 0.3, 0.4]], dtype=np.float32)


def one(primary, shadow, **kwargs) -> OutputAgreement:
    [agreement] = compare_outputs({"y": primary}, {"y": shadow}, **kwargs)
    return agreement


def test_identical_scores_agree_on_every_row():
    assert one(LOGITS, LOGITS.copy()) == OutputAgreement("y", 4, 4, 0.0, False)


def test_a_small_difference_shows_in_max_abs_diff_but_not_top1():
    shadow = LOGITS.copy()
    shadow[1, 2] += 0.001
    agreement = one(LOGITS, shadow)
    assert agreement.top1_matches == 4
    assert agreement.max_abs_diff is not None and math.isclose(agreement.max_abs_diff, 0.001, rel_tol=1e-3)


def test_a_flipped_argmax_is_one_disagreeing_row():
    shadow = LOGITS.copy()
    shadow[2] = [0.9, 0.1, 0.0]
    agreement = one(LOGITS, shadow)
    assert agreement.rows == 4 and agreement.top1_matches == 3
    assert agreement.max_abs_diff is not None and math.isclose(agreement.max_abs_diff, 0.9, rel_tol=1e-6)


def test_a_sequence_row_agrees_only_when_every_position_does():
    primary = np.zeros((2, 3, 5))
    primary[..., 1] = 1.0
    shadow = primary.copy()
    shadow[1, 2] = [0, 0, 0, 0, 1.0]  # one token of the second row flips
    assert one(primary, shadow).top1_matches == 1


def test_shape_or_kind_mismatch_and_missing_outputs_disagree_on_every_row():
    assert one(LOGITS, LOGITS[:, :2]) == OutputAgreement("y", 4, 0, None, True)
    assert one(LOGITS, LOGITS.astype(np.int64)).shape_mismatch
    narrow = one(LOGITS, LOGITS.astype(np.float16))  # a float is a float, whatever its width
    assert not narrow.shape_mismatch and narrow.top1_matches == 4
    found = compare_outputs({"a": LOGITS, "b": LOGITS}, {"a": LOGITS, "c": np.zeros(7)})
    assert [(f.output, f.rows, f.top1_matches, f.shape_mismatch) for f in found] == [
        ("a", 4, 4, False), ("b", 4, 0, True), ("c", 7, 0, True)]


def test_nan_against_nan_is_equal_and_nan_against_a_number_is_infinitely_far():
    primary = np.array([[np.nan, 1.0], [np.inf, -np.inf]])
    assert one(primary, primary.copy()).max_abs_diff == 0.0
    shadow = primary.copy()
    shadow[0, 0] = 5.0
    assert one(primary, shadow).max_abs_diff == math.inf
    shadow = primary.copy()
    shadow[1, 0] = -np.inf
    assert one(primary, shadow).max_abs_diff == math.inf


def test_int_scores_have_top1_and_int_labels_only_a_difference():
    scores = np.array([[1, 5, 2], [7, 0, 0]], dtype=np.int32)
    assert one(scores, np.array([[1, 5, 2], [0, 0, 7]], dtype=np.int64)) == OutputAgreement("y", 2, 1, 7.0, False)
    labels = np.array([3, 1, 2], dtype=np.int64)  # a scalar per row: no score axis
    assert one(labels, np.array([3, 1, 0], dtype=np.uint8)) == OutputAgreement("y", 3, None, 2.0, False)


def test_an_unbatched_model_answers_one_row():
    assert one(LOGITS[0], LOGITS[0], batched=False) == OutputAgreement("y", 1, 1, 0.0, False)
    assert one(LOGITS, LOGITS[::-1].copy(), batched=False).top1_matches == 0
    assert one(np.float32(3.0), np.float32(2.5), batched=False) == OutputAgreement("y", 1, None, 0.5, False)


def test_string_outputs_are_compared_by_shape_only():
    words = np.array(["cat", "dog"], dtype=object)
    assert one(words, np.array(["cat", "cow"], dtype=object)) == OutputAgreement("y", 2, None, None, False)
    assert one(words, np.array(["cat"], dtype=object)).shape_mismatch
    assert one(words.astype(str), words.astype(str)) == OutputAgreement("y", 2, None, None, False)


NUMERIC = st.one_of(hnp.integer_dtypes(), hnp.unsigned_integer_dtypes(), hnp.floating_dtypes(),
                    hnp.complex_number_dtypes(), hnp.boolean_dtypes())
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)


def arrays(shape=SHAPES):
    return NUMERIC.flatmap(lambda dtype: hnp.arrays(dtype, shape))


@st.composite
def pairs(draw):
    """Two arrays of one shape half the time (the values differ, the dtypes may), of any two shapes otherwise."""
    if draw(st.booleans()):
        shape = draw(SHAPES)
        return draw(arrays(st.just(shape))), draw(arrays(st.just(shape)))
    return draw(arrays()), draw(arrays())


@given(pairs(), st.booleans())
def test_never_raises_for_arbitrary_numeric_arrays(pair, batched):
    primary, shadow = pair
    agreement = one(primary, shadow, batched=batched)
    assert agreement.rows >= 0
    assert agreement.top1_matches is None or 0 <= agreement.top1_matches <= agreement.rows
    assert agreement.max_abs_diff is None or agreement.max_abs_diff >= 0


@given(arrays(), st.booleans())
def test_an_array_fully_agrees_with_its_copy(array, batched):
    agreement = one(array, array.copy(), batched=batched)
    assert not agreement.shape_mismatch
    assert agreement.max_abs_diff == 0.0
    assert agreement.top1_matches is None or agreement.top1_matches == agreement.rows


assert fuzzing.PROPERTY_EXAMPLES > 0
