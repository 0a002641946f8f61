import numpy as np
import pytest

from trtserve.engine_dir.manifest import Shapes
from trtserve.errors import InputError
from trtserve.runtime.base import TensorSpec, check_feeds
from trtserve.runtime.generate import positions_from_mask

SPECS = (
    TensorSpec("input_ids", "int64", ("batch", "sequence")),
    TensorSpec("attention_mask", "int64", ("batch", "total_sequence")),
    TensorSpec("past_key_values.0.key", "float32", ("batch", 3, "past_sequence", 64)),
)
RANGES = Shapes.model_validate({
    "batch": {"min": 1, "opt": 1, "max": 4},
    "sequence": {"min": 1, "opt": 8, "max": 16},
    "past_sequence": {"min": 0, "opt": 8, "max": 15},
    "total_sequence": {"min": 1, "opt": 8, "max": 16},
})


def feeds(batch=2, seq=3, past=4, total=None, heads=3):
    return {
        "input_ids": np.zeros((batch, seq), np.int64),
        "attention_mask": np.ones((batch, past + seq if total is None else total), np.int64),
        "past_key_values.0.key": np.zeros((batch, heads, past, 64), np.float32),
    }


def test_valid_feeds_bind_every_axis():
    assert check_feeds(feeds(), SPECS, RANGES) == {"batch": 2, "sequence": 3, "total_sequence": 7, "past_sequence": 4}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (feeds(batch=5), r"batch=5 is outside the engine's range \[1, 4\]; rebuild with a larger --max-batch"),
        (feeds(seq=17, past=0), r"sequence=17 is outside .* --max-seq"),
        (feeds(heads=2), "size 2 on an axis fixed at 3"),
        (feeds(total=9), r"attention_mask covers 9 positions but past \(4\) \+ new tokens \(3\) = 7"),
    ],
)
def test_bad_feeds_say_what_is_wrong(bad, message):
    with pytest.raises(InputError, match=message):
        check_feeds(bad, SPECS, RANGES)


def test_wrong_names_and_dtypes():
    wrong = feeds()
    del wrong["attention_mask"]
    wrong["mask"] = np.ones((2, 7), np.int64)
    with pytest.raises(InputError, match=r"missing \['attention_mask'\], unexpected \['mask'\]"):
        check_feeds(wrong, SPECS, RANGES)
    wrong = feeds()
    wrong["input_ids"] = wrong["input_ids"].astype(np.int32)
    with pytest.raises(InputError, match="input_ids has dtype int32, the engine expects int64"):
        check_feeds(wrong, SPECS, RANGES)


def test_positions_count_from_the_first_real_token():
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert positions_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
