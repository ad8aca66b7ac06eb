"""`measure.placement.quiet_engine_deprecations` (called by `init_group`, where every rank of `ciera train`,
`ciera measure` and `benchmarks/train_step.py` forms its group): torch's deprecation notice for the
collectives DeepSpeed calls is dropped, and only it."""

import warnings

from measure.placement import quiet_engine_deprecations


def _caught(emit) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_engine_deprecations()
        emit()
    return [str(w.message) for w in caught]


def test_the_collectives_deprecation_is_dropped() -> None:
    message = (
        "`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
        "`torch.distributed.all_gather_single` instead."
    )
    assert _caught(lambda: warnings.warn(message, FutureWarning, stacklevel=1)) == []


def test_other_warnings_still_print() -> None:
    def emit() -> None:
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated", UserWarning, stacklevel=1)
        warnings.warn("`torch.load` is deprecated", FutureWarning, stacklevel=1)
        warnings.warn("something else", FutureWarning, stacklevel=1)

    assert len(_caught(emit)) == 3
