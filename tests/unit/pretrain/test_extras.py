"""A command that needs one of pyproject.toml's extras says which when it is missing, instead of an ImportError."""

import sys

import pytest

from pretrain.job.extras import needs_extra


def test_a_missing_module_ends_the_program_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy", None)  # as if not installed
    with pytest.raises(SystemExit) as exit_:
        with needs_extra("research"):
            from scipy import stats  # noqa: F401
    assert exit_.value.code == ("error: cannot import scipy, which comes with ora's research extra: "
                                "pip install 'ora[research]' (from a checkout: pip install -e '.[research]')")


def test_what_imports_goes_on_and_other_errors_stay_theirs():
    with needs_extra("research"):
        import json
    assert json.dumps(1) == "1"
    with pytest.raises(ValueError, match="not about imports"):
        with needs_extra("eval"):
            raise ValueError("not about imports")
