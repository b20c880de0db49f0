"""bk.testing.env_settings: settings the whole suite's bookies run with."""

import pytest

from bk.errors import BKError
from bk.testing import env_settings


def test_settings_from_the_environment_and_a_key_that_does_not_exist():
    assert env_settings({}) == {}
    assert env_settings({"BK_TEST_SETTINGS": "journalDirectWrites=true, flushInterval=500,"}) == \
        {"journalDirectWrites": "true", "flushInterval": "500"}
    for bad in ("journalDirectWrite=true", "journalDirectWrites"):
        with pytest.raises(BKError, match="BK_TEST_SETTINGS"):
            env_settings({"BK_TEST_SETTINGS": bad})
