"""The tiny DeepSpec reference target, shared with the drafter tests."""

from tests.drafters.conftest import target  # noqa: F401 - pytest fixture
