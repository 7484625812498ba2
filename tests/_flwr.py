"""Whether Flower can run here, for the tests that need a real ``flwr``.

flwr is part of the ``[test]`` extra wherever it can be installed (Python >= 3.11):
there its absence fails these tests (they run and their imports fail); only on Python
3.10, where flwr 1.41 cannot be installed, are they skipped."""

import sys

import pytest

try:
    import flwr  # noqa: F401

    HAVE_FLWR = True
except ImportError:
    HAVE_FLWR = False

needs_flwr = pytest.mark.skipif(
    not HAVE_FLWR and sys.version_info < (3, 11),
    reason="flwr 1.41 needs Python >= 3.11 (the Flower integration tests cannot run on this Python)")
