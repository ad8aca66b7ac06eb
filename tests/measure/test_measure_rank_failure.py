"""A rank's failure is one line for its launcher; CIERA_TRACEBACK=1 adds the traceback on the rank's
stderr (its log under a capture, the console under `ciera train`)."""

from __future__ import annotations

import pytest

from measure.rank import TRACEBACK_ENV, failure_text


def _fail() -> None:
    raise RuntimeError("The size of tensor a (0) must match the size of tensor b (176)\nsecond line")


@pytest.mark.parametrize(("environ", "traceback_shown"), [({}, False), ({TRACEBACK_ENV: "1"}, True),
                                                          ({TRACEBACK_ENV: "0"}, False)])  # fmt: skip
def test_a_failure_is_one_line_and_the_traceback_only_on_request(capsys, environ, traceback_shown) -> None:
    try:
        _fail()
    except RuntimeError as error:
        text = failure_text(error, environ)
    assert text == "RuntimeError: The size of tensor a (0) must match the size of tensor b (176)"
    err = capsys.readouterr().err
    assert ("Traceback (most recent call last)" in err) == traceback_shown
    if traceback_shown:
        assert "in _fail" in err and "second line" in err


def test_an_error_without_a_message_names_its_type() -> None:
    try:
        raise KeyError()
    except KeyError as error:
        assert failure_text(error, {}) == "KeyError: "
