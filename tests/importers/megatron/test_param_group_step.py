"""A Megatron optimizer's ``param_groups[i]['step']`` read from a (hostile) file: one number, or
an error naming the group and what was found (a list, a string or a tensor of several values
gave numpy's TypeError / ValueError, naming nothing)."""

import numpy as np
import pytest

from jax_ucp._src.importers.megatron.common import MegatronImportError, step_from_param_groups


@pytest.mark.parametrize("step", [7, 7.0, np.int64(7), np.array(7), np.array([7.0])])
def test_a_step_of_one_number_is_read(step):
    assert step_from_param_groups([{"step": step}, {"step": 7}], "f.pt") == 7


@pytest.mark.parametrize("step", [[7, 8], "7", np.arange(3), {"s": 7}, None, True])
def test_a_step_that_is_not_one_number_is_refused_naming_the_group(step):
    with pytest.raises(MegatronImportError, match=r"f\.pt: optimizer param_groups\[1\]\['step'\]"):
        step_from_param_groups([{"step": 7}, {"step": step}], "f.pt")
